"""POST /v1/score (and /score) and POST /v1/rerank (and /rerank, /v2/rerank) for the embedding model.

A score is the cosine similarity of two texts' embeddings (the embedder's vectors are unit
length, so it is their dot product), in [-1, 1]. The request and reply shapes are the ones
clients already send and read:
  /v1/score   vLLM's: `text_1` and `text_2`, each a string or a list (one against many, or
              pairwise for two lists of one length) -> `data: [{"index", "object": "score", "score"}]`.
  /v1/rerank  vLLM's, Jina's and Cohere's (the `cohere` client's v1 and v2 rerank): `query`,
              `documents` (strings, or Cohere's `{"text": ...}` objects), `top_n` ->
              `results: [{"index", "relevance_score", "document": {"text"}}]`, best first.
A document longer than the model's context is cut to its first tokens, as Cohere's API does
(`max_tokens_per_doc` cuts it shorter); a query that long is a 400.
"""

from typing import Any, ClassVar

from fastapi import Request
from pydantic import Field

from scratchllm.server.embeddings import embed
from scratchllm.server.messages import Strict
from scratchllm.server.protocol import Refusals, _Request, bad_request, new_id, now_s, parse_body
from scratchllm.server.registry import ModelRegistry, models_of
from scratchllm.server.state import ServedEmbedder

MAX_DOCUMENTS = 256  # as many inputs as one embeddings request takes


class ScoreRequest(_Request):
    model: str
    text_1: str | list[str]
    text_2: str | list[str]
    encoding_format: str | None = None  # accepted, no effect: scores are numbers
    user: str | None = None  # accepted, no effect
    truncate_prompt_tokens: int | None = Field(None, ge=1)  # vLLM's: keep each text's first tokens

    def pairs(self) -> list[tuple[str, str]]:
        one = [self.text_1] if isinstance(self.text_1, str) else self.text_1
        two = [self.text_2] if isinstance(self.text_2, str) else self.text_2
        if not one or not two:
            raise bad_request("'text_1' and 'text_2' must not be empty", param="text_1" if not one else "text_2")
        if len(one) == 1:
            return [(one[0], t) for t in two]
        if len(one) != len(two):
            raise bad_request(f"'text_1' has {len(one)} texts and 'text_2' {len(two)}: give one text_1, or "
                              "lists of one length (scored pairwise)", param="text_2")
        return list(zip(one, two, strict=True))


class CohereDocument(Strict):
    text: str


class RerankRequest(_Request):
    REFUSED: ClassVar[Refusals] = {
        "rank_fields": ((None, ["text"]), "documents are ranked by their text"),
    }

    model: str
    query: str
    documents: list[str | CohereDocument]
    top_n: int | None = Field(None, ge=0)  # 0 or none: every document
    return_documents: bool = True
    max_tokens_per_doc: int | None = Field(None, ge=1)  # Cohere v2's: keep each document's first tokens
    max_chunks_per_doc: int | None = Field(None, ge=1)  # Cohere v1's: accepted, no effect (one chunk each)
    truncate_prompt_tokens: int | None = Field(None, ge=1)  # vLLM's: as max_tokens_per_doc
    rank_fields: Any = None
    user: str | None = None  # accepted, no effect

    def texts(self) -> list[str]:
        if not self.documents:
            raise bad_request("'documents' is empty", param="documents")
        if len(self.documents) > MAX_DOCUMENTS:
            raise bad_request(f"at most {MAX_DOCUMENTS} documents per request", param="documents")
        return [d if isinstance(d, str) else d.text for d in self.documents]


async def _similarities(registry: ModelRegistry, emb: ServedEmbedder, queries: list[str], docs: list[str],
                        truncate: int | None, query_param: str, doc_param: str) -> tuple[list[float], int]:
    """The cosine similarity of each (query, document) pair, and the tokens embedded."""
    distinct = sorted(set(queries), key=queries.index)
    q_vectors, n_q = await embed(registry, emb, distinct, query_param)
    d_vectors, n_d = await embed(registry, emb, docs, doc_param, truncate=truncate or emb.max_len)
    row = {q: i for i, q in enumerate(distinct)}
    return [float(q_vectors[row[q]] @ d_vectors[j]) for j, q in enumerate(queries)], n_q + n_d


async def score(request: Request) -> dict[str, Any]:
    registry = models_of(request)
    req = parse_body(await request.body(), ScoreRequest, lenient=registry.config.lenient_fields)
    registry.entry(req.model, "embed")  # an unknown name is refused before anything else
    pairs = req.pairs()
    if len(pairs) > MAX_DOCUMENTS:
        raise bad_request(f"at most {MAX_DOCUMENTS} pairs per request", param="text_2")
    emb = await registry.embedder(request, req.model)
    scores, n = await _similarities(registry, emb, [a for a, _ in pairs], [b for _, b in pairs],
                                    req.truncate_prompt_tokens, "text_1", "text_2")
    return {"id": new_id("score"), "object": "list", "created": now_s(), "model": req.model,
            "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
            "usage": {"prompt_tokens": n, "total_tokens": n, "completion_tokens": 0}}


async def rerank(request: Request) -> dict[str, Any]:
    registry = models_of(request)
    req = parse_body(await request.body(), RerankRequest, lenient=registry.config.lenient_fields)
    registry.entry(req.model, "embed")
    docs = req.texts()
    emb = await registry.embedder(request, req.model)
    scores, n = await _similarities(registry, emb, [req.query] * len(docs), docs,
                                    req.max_tokens_per_doc or req.truncate_prompt_tokens, "query", "documents")
    order = sorted(range(len(docs)), key=lambda i: (-scores[i], i))[:req.top_n or None]
    results = [{"index": i, "relevance_score": scores[i], **({"document": {"text": docs[i]}} if req.return_documents
                                                                else {})} for i in order]
    return {"id": new_id("rerank"), "model": req.model, "results": results,
            "usage": {"prompt_tokens": n, "total_tokens": n}}
