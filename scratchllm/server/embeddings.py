"""POST /v1/embeddings: tokenize, pad into one batch, embed off the event loop.

The forward pass is NumPy (it releases the GIL in its GEMMs), run with `asyncio.to_thread` so
the loop keeps serving streams meanwhile; one batch at a time (a lock), because two concurrent
batches only fight over the same cores. `encoding_format="base64"` is little-endian float32, which
is what the official client asks for by default and decodes with NumPy.
"""

import asyncio
import base64
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
from fastapi import Request

from scratchllm.server.protocol import APIError, EmbeddingRequest, bad_request, parse_body
from scratchllm.server.registry import ModelRegistry, models_of
from scratchllm.server.state import ServedEmbedder
from scratchllm.tokenizer.tokenizer import pad_batch

MAX_INPUTS = 256  # inputs in one request; more is a client bug more often than a real batch


async def create_embeddings(request: Request) -> dict[str, Any]:
    registry = models_of(request)
    req = parse_body(await request.body(), EmbeddingRequest, lenient=registry.config.lenient_fields)
    registry.entry(req.model, "embed")  # an unknown name is refused before anything else
    if req.dimensions is not None:
        raise bad_request("'dimensions' is not supported: this model's size is fixed", param="dimensions")
    inputs = req.inputs()
    emb = await registry.embedder(request, req.model)  # loaded only for a request that can run
    vectors, n = await embed(registry, emb, inputs)
    data = [{"object": "embedding", "index": i, "embedding": _encode(v, req.encoding_format)}
            for i, v in enumerate(vectors)]
    return {"object": "list", "data": data, "model": req.model, "usage": {"prompt_tokens": n, "total_tokens": n}}


async def embed(registry: ModelRegistry, emb: ServedEmbedder, inputs: Sequence[str | list[int]],
                param: str = "input", truncate: int | None = None) -> tuple[npt.NDArray[np.float32], int]:
    """(unit vectors [len(inputs), hidden], tokens embedded) of texts or token-id lists; bad
    input is a 400 naming `param`. `truncate`: keep each input's first tokens (at most the
    model's length) instead of refusing a longer one. Shared by /v1/embeddings, /v1/score,
    /v1/rerank and Ollama's /api/embed."""
    if len(inputs) > MAX_INPUTS:
        raise bad_request(f"at most {MAX_INPUTS} inputs per request, got {len(inputs)}", param=param)
    rows: list[list[int]] = []
    for x in inputs:
        row = emb.tokenizer.encode(x, add_special_tokens=True) if isinstance(x, str) else list(x)
        if truncate is not None:
            row = row[:min(truncate, emb.max_len)]
        if not row:
            raise bad_request(f"an input in '{param}' is empty", param=param)
        if len(row) > emb.max_len:
            raise bad_request(f"an input has {len(row)} tokens; this model takes at most {emb.max_len}",
                              param=param, code="context_length_exceeded")
        if any(not isinstance(t, int) or not 0 <= t < emb.tokenizer.vocab_size for t in row):
            raise bad_request(f"'{param}' has token ids outside the vocabulary", param=param)
        rows.append(row)
    ids, mask = pad_batch(rows, getattr(emb.tokenizer, "pad_token_id", 0) or 0)
    async with registry.embed_lock:
        try:
            vectors = await asyncio.to_thread(emb.embed, ids, mask)  # [B, hidden]
        except Exception as err:  # noqa: BLE001 - any failure of the model is this request's 500, not a crash
            raise APIError(500, f"embedding failed: {type(err).__name__}", type="server_error") from None
    vectors = np.asarray(vectors, dtype=np.float32)
    assert vectors.shape[0] == len(rows)
    return vectors, int(mask.sum())


def _encode(vector: npt.NDArray[np.float32], fmt: str) -> str | list[float]:
    if fmt == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    floats: list[float] = vector.tolist()
    return floats
