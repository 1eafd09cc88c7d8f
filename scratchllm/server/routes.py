"""The server's endpoints, one row each: the one table that the app registers (server/app.py),
/openapi.json documents (server/openapi.py), the evaluation loop replays (evaluate/sources.py)
and the errors take their shape from.

Adding an endpoint is its handler plus one `Route` row here. A row says:
- `method`, `path`, `handler`: what FastAPI registers (the handler reads its own body with
  `parse_body`, so FastAPI infers nothing from its signature);
- `body`: the request's pydantic model, which /openapi.json describes (None: no JSON body, or
  one too small to describe);
- `in_schema`: False for another server's spelling of a documented route (`/rerank` beside
  `/v1/rerank`), left out of /openapi.json;
- `replay`: the evaluation loop can capture and replay its requests (an OpenAI generation
  endpoint whose reply carries choices and logprobs);
- `batch`: a Batch API input line may name it as its url (server/batch_api.py);
- `errors`: the body an error gets on this path (OpenAI's `{"error": {...}}` unless the row says
  otherwise; Ollama's `{"error": "..."}` on its /api/ paths);
- `keyless`: served without the API key (version probes); every other route needs it;
- `body_limit`: False for a route that takes files (Ollama's blobs), which streams its body to
  disk: `--max-body-bytes` holds for every other.

/health, /metrics, /openapi.json and the chat page at / are the app's own, not API endpoints:
they stay in server/app.py, server/openapi.py and server/chat_page.py.
"""

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel

from scratchllm.server import (
    anthropic_messages,
    batch_api,
    chat,
    completions,
    embeddings,
    infill,
    model_names,
    ollama,
    rerank,
    responses,
    utility,
)
from scratchllm.server.anthropic_protocol import AnthropicCountRequest, AnthropicRequest, anthropic_error_body
from scratchllm.server.errors import APIError
from scratchllm.server.infill import InfillRequest
from scratchllm.server.ollama_protocol import error_body as ollama_error_body
from scratchllm.server.protocol import ChatCompletionRequest, CompletionRequest, EmbeddingRequest
from scratchllm.server.rerank import RerankRequest, ScoreRequest
from scratchllm.server.responses_request import ResponsesRequest

ErrorShape = Callable[[APIError], dict[str, Any]]


def openai_error_body(err: APIError) -> dict[str, Any]:
    return err.body()


@dataclass(frozen=True)
class Route:
    method: Literal["GET", "POST", "DELETE", "HEAD"]
    path: str
    handler: Callable[..., Any]
    body: type[BaseModel] | None = None
    in_schema: bool = True
    replay: bool = False
    batch: bool = False
    errors: ErrorShape = openai_error_body
    keyless: bool = False
    body_limit: bool = True


OLLAMA = ollama_error_body

ROUTES: tuple[Route, ...] = (
    # OpenAI's API (and vLLM's additions)
    Route("POST", "/v1/completions", completions.completions, CompletionRequest, replay=True, batch=True),
    Route("POST", "/v1/chat/completions", chat.chat_completions, ChatCompletionRequest, replay=True, batch=True),
    Route("POST", "/v1/embeddings", embeddings.create_embeddings, EmbeddingRequest, batch=True),
    Route("POST", "/v1/responses", responses.create_response, ResponsesRequest),
    Route("POST", "/v1/score", rerank.score, ScoreRequest),
    Route("POST", "/v1/rerank", rerank.rerank, RerankRequest),
    Route("GET", "/v1/models", utility.models),
    Route("GET", "/v1/models/{model_id}", utility.model),
    # OpenAI's Files and Batch API
    Route("POST", "/v1/files", batch_api.upload_file, body_limit=False),
    Route("GET", "/v1/files", batch_api.list_files),
    Route("GET", "/v1/files/{file_id}", batch_api.retrieve_file),
    Route("DELETE", "/v1/files/{file_id}", batch_api.delete_file),
    Route("GET", "/v1/files/{file_id}/content", batch_api.file_content),
    Route("POST", "/v1/batches", batch_api.create_batch, batch_api.BatchCreateRequest),
    Route("GET", "/v1/batches", batch_api.list_batches),
    Route("GET", "/v1/batches/{batch_id}", batch_api.retrieve_batch),
    Route("POST", "/v1/batches/{batch_id}/cancel", batch_api.cancel_batch),
    # other servers' spellings of the same
    Route("POST", "/score", rerank.score, in_schema=False),
    Route("POST", "/rerank", rerank.rerank, in_schema=False),
    Route("POST", "/v2/rerank", rerank.rerank, in_schema=False),
    # Anthropic's Messages API (captured and replayed as the chat request it runs as)
    Route("POST", "/v1/messages", anthropic_messages.messages, AnthropicRequest, errors=anthropic_error_body),
    Route("POST", "/v1/messages/count_tokens", anthropic_messages.count_tokens, AnthropicCountRequest,
          errors=anthropic_error_body),
    # llama.cpp's fill-in-the-middle (captured and replayed as the /v1/completions request it runs as)
    Route("POST", "/infill", infill.infill, InfillRequest),
    Route("POST", "/v1/infill", infill.infill, in_schema=False),
    # vLLM's utilities
    Route("POST", "/tokenize", utility.tokenize),
    Route("POST", "/detokenize", utility.detokenize),
    Route("GET", "/version", utility.version, keyless=True),
    # Ollama's API
    Route("POST", "/api/generate", ollama.generate, errors=OLLAMA),
    Route("POST", "/api/chat", ollama.chat_route, errors=OLLAMA),
    Route("POST", "/api/embed", ollama.embed_route, errors=OLLAMA),
    Route("POST", "/api/embeddings", ollama.embeddings_route, errors=OLLAMA),
    Route("GET", "/api/tags", ollama.tags, errors=OLLAMA),
    Route("POST", "/api/show", ollama.show, errors=OLLAMA),
    Route("GET", "/api/ps", ollama.ps, errors=OLLAMA),
    Route("GET", "/api/version", ollama.version, errors=OLLAMA, keyless=True),
    # Ollama's model management
    Route("POST", "/api/pull", model_names.pull_route, model_names.OllamaPullRequest, errors=OLLAMA),
    Route("POST", "/api/create", model_names.create_route, model_names.OllamaCreateRequest, errors=OLLAMA),
    Route("POST", "/api/copy", model_names.copy_route, model_names.OllamaCopyRequest, errors=OLLAMA),
    Route("DELETE", "/api/delete", model_names.delete_route, model_names.OllamaDeleteRequest, errors=OLLAMA),
    Route("HEAD", "/api/blobs/{digest}", model_names.blob_exists, errors=OLLAMA),
    Route("POST", "/api/blobs/{digest}", model_names.blob_upload, errors=OLLAMA, body_limit=False),
)

REPLAYABLE: tuple[str, ...] = tuple(r.path for r in ROUTES if r.replay)
BATCHABLE: tuple[str, ...] = tuple(r.path for r in ROUTES if r.batch)

API_PREFIXES = ("/v1/", "/api/")  # a path under these that no route has is still the API's (404)


_index: tuple[tuple[Route, ...], dict[str, list[Route]], list[tuple[re.Pattern[str], Route]]] | None = None


def _matching(path: str) -> list[Route]:
    """The rows a request path is for (any method): the literal paths by a dict, the few with a
    `{name}` segment by pattern; the index is built once per table (by identity)."""
    global _index
    if _index is None or _index[0] is not ROUTES:
        exact: dict[str, list[Route]] = {}
        patterned = []
        for r in ROUTES:
            if "{" in r.path:
                patterned.append((re.compile(re.sub(r"\\\{\w+\\\}", "[^/]+", re.escape(r.path)) + "$"), r))
            else:
                exact.setdefault(r.path, []).append(r)
        _index = (ROUTES, exact, patterned)
    _, exact, patterned = _index
    return exact.get(path) or [r for pattern, r in patterned if pattern.match(path)]


def find(path: str) -> Route | None:
    """The route a request path is for (any method), or None."""
    return next(iter(_matching(path)), None)


def error_shape(path: str) -> ErrorShape:
    """The error body for a request path: its route's; a path no route has (a 404, or a 401 that
    the API key gave before routing) is Ollama's under /api/ and OpenAI's elsewhere."""
    route = find(path)
    if route is not None:
        return route.errors
    return ollama_error_body if ollama.is_ollama(path) else openai_error_body


def body_limited(path: str) -> bool:
    """Whether --max-body-bytes holds for a path (every path but the rows that take files)."""
    return all(route.body_limit for route in _matching(path))


def needs_key(path: str) -> bool:
    """Whether the API key guards a path: every route but the keyless ones, and any path under
    the API's prefixes (so that probing for routes without the key learns nothing)."""
    route = find(path)
    return not route.keyless if route is not None else path.startswith(API_PREFIXES)
