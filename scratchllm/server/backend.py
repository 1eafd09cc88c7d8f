"""The backends a server can serve: a model behind the continuous engine or the static
baseline, an encoder model for embeddings, or the fake engine (no model). The models come from
the engine's one loader (engine/load.py); this module picks the engine and shapes what it serves.

`model_specs` turns model references into the registry's specs (server/registry.py): each
model planned from its header in one memory plan (engine/shared_memory_plan.py) before anything
loads, so what does not fit is refused at start, never an OOM mid-traffic; each spec loads its
model when the registry asks (at start, or on first use), within its share of the plan.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from scratchllm.errors import ConfigError
from scratchllm.server.registry import ModelSpec
from scratchllm.server.state import ServedEmbedder, ServedModel
from scratchllm.trace.writer import TraceWriter

if TYPE_CHECKING:
    from scratchllm.engine.shared_memory_plan import SharedPlan

STATIC_OPTIONS = {"max_num_seqs", "max_model_len", "num_kv_blocks"}
FAKE_EMBED_MAX_LEN = 512


def load_model(ref: str, name: str, engine_options: dict[str, Any], trace: TraceWriter | None = None) -> ServedModel:
    """`ref` (default, a .gguf, a folder) behind an AsyncEngine; engine_options go to EngineConfig;
    the engine writes every token into `trace` when given. `batching="static"` serves the static
    baseline instead (engine/static.py), which is not traced."""
    from scratchllm.engine.async_engine import AsyncEngine
    from scratchllm.engine.engine import LLMEngine

    engine_options = dict(engine_options)
    dtype = engine_options.pop("dtype", "float32")
    if engine_options.pop("batching", "continuous") == "static":
        return _load_static(ref, name, engine_options, dtype)
    try:
        engine = LLMEngine.from_pretrained(ref, tokenizer=True, dtype=dtype, trace=trace, **engine_options)
    except TypeError as err:  # an option EngineConfig does not have
        raise ConfigError(f"engine option: {err}") from None
    if engine.tokenizer is None:
        raise ConfigError(f"model '{ref}' has no tokenizer: the server needs one for text prompts")
    return ServedModel(name, AsyncEngine(engine), engine.tokenizer, engine.max_model_len)


def _load_static(ref: str, name: str, options: dict[str, Any], dtype: str = "float32") -> ServedModel:
    from scratchllm.engine.load import load_weights
    from scratchllm.engine.static import StaticEngine

    unknown = set(options) - STATIC_OPTIONS
    if unknown:
        raise ConfigError(f"--batching static does not take {sorted(unknown)}")
    model, tokenizer = load_weights(ref, dtype)
    assert tokenizer is not None  # load_weights was asked for it
    engine = StaticEngine(model, tokenizer, batch_size=options.get("max_num_seqs") or 8,
                          max_model_len=options.get("max_model_len"))
    return ServedModel(name, engine, tokenizer, engine.max_model_len)


def load_embedder(ref: str) -> ServedEmbedder:
    """An encoder model (BERT family, e.g. `minilm`) with `embed(input_ids, attention_mask)`."""
    from scratchllm.engine.load import load_weights

    model, tokenizer = load_weights(ref, dtype="auto")
    assert tokenizer is not None
    if not hasattr(model, "embed"):
        raise ConfigError(f"--embedding-model '{ref}' is not an encoder model (it has no embeddings)")
    max_len = min(model.config.max_position_embeddings, tokenizer.model_max_length or 1 << 30)
    return ServedEmbedder(ref, model.embed, tokenizer, max_len)


def model_specs(refs: list[str], engine_options: dict[str, Any], trace: TraceWriter | None = None,
                budget_bytes: int | None = None) -> tuple[list[ModelSpec], SharedPlan]:
    """A spec per reference (served under the reference as given), and their memory plan. Each
    generation model's engine plans its pool within its share of the plan when several are
    served or a budget is given; one model alone plans against the machine, as it always has."""
    from scratchllm.engine.shared_memory_plan import plan_models

    plan = plan_models(refs, engine_options, budget_bytes)
    generators = sum(need.task == "generate" for need in plan.needs)
    share = (budget_bytes is not None or generators > 1) and engine_options.get("batching") != "static"
    specs = []
    for need in plan.needs:
        if need.task == "generate":
            options = plan.engine_options(need, engine_options) if share else engine_options
            # the model's own writer: its records carry its name (named in the ring from the start)
            model_trace = trace.for_model(need.ref) if trace is not None else None
            load: Any = functools.partial(load_model, need.ref, need.ref, options, model_trace)
        else:
            load = functools.partial(load_embedder, need.ref)
        specs.append(ModelSpec(need.ref, "generate" if need.task == "generate" else "embed", load,
                               planned_bytes=need.total_bytes, max_len=need.max_len, details=need.details))
    return specs, plan


def fake_specs(names: list[str], embedder: bool = True, max_model_len: int = 2048,
               **engine_options: Any) -> list[ModelSpec]:
    """Specs of fake-engine models under `names` (and the fake embedder, "fake-embed"), each a new
    FakeEngine when it loads: for `serve --fake-engine NAME...` and tests."""
    def load_fake(name: str) -> ServedModel:
        from scratchllm.engine.fake import FakeEngine

        engine = FakeEngine(max_model_len=max_model_len, **engine_options)
        return ServedModel(name, engine, engine.tokenizer, max_model_len)

    def load_fake_embed() -> ServedEmbedder:
        from scratchllm.engine.fake import FakeTokenizer

        return ServedEmbedder("fake-embed", fake_embed, FakeTokenizer(), max_len=FAKE_EMBED_MAX_LEN)

    specs = [ModelSpec(n, "generate", functools.partial(load_fake, n), max_len=max_model_len,
                       details={"family": "fake", "format": "none"}) for n in names]
    if embedder:
        specs.append(ModelSpec("fake-embed", "embed", load_fake_embed, max_len=FAKE_EMBED_MAX_LEN,
                               details={"family": "fake", "format": "none"}))
    return specs


def fake_embed(input_ids: npt.NDArray[np.integer[Any]],
               attention_mask: npt.NDArray[np.integer[Any]]) -> npt.NDArray[np.float32]:  # [B, T], [B, T] -> [B, 32]
    """A deterministic stand-in for MiniLM: mean of fixed per-token vectors, L2-normalized."""
    from scratchllm.engine.fake import BYTE_TOKENS

    table = np.random.default_rng(0).standard_normal((BYTE_TOKENS, 32)).astype(np.float32)
    ids = np.asarray(input_ids) % BYTE_TOKENS  # opaque ids share the byte rows
    mask = np.asarray(attention_mask, dtype=np.float32)[..., None]
    pooled = (table[ids] * mask).sum(1) / np.maximum(mask.sum(1), 1.0)
    unit: npt.NDArray[np.float32] = pooled / np.linalg.norm(pooled, axis=1, keepdims=True)
    return unit


def fake_backend(max_model_len: int = 2048, **engine_options: Any) -> tuple[ServedModel, ServedEmbedder]:
    """(ServedModel, ServedEmbedder) over the fake engine, for `serve --fake-engine` and tests."""
    from scratchllm.engine.fake import FakeEngine

    engine = FakeEngine(max_model_len=max_model_len, **engine_options)
    model = ServedModel("fake", engine, engine.tokenizer, max_model_len)
    return model, ServedEmbedder("fake-embed", fake_embed, engine.tokenizer, max_len=FAKE_EMBED_MAX_LEN)
