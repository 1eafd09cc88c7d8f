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
- `errors`: the body an error gets on this path (OpenAI's `{"error": {...}}` unless the row says
  otherwise; Ollama's `{"error": "..."}` on its /api/ paths);
- `keyless`: served without the API key (version probes); every other route needs it.

/health, /metrics, /openapi.json and the chat page at / are the app's own, not API endpoints:
they stay in server/app.py, server/openapi.py and server/chat_page.py.
"""

import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Literal

from pydantic import BaseModel

from scratchllm.server import (
    anthropic_messages,
    chat,
    completions,
    embeddings,
    infill,
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
    method: Literal["GET", "POST", "DELETE"]
    path: str
    handler: Callable[..., Any]
    body: type[BaseModel] | None = None
    in_schema: bool = True
    replay: bool = False
    errors: ErrorShape = openai_error_body
    keyless: bool = False


OLLAMA = ollama_error_body

ROUTES: tuple[Route, ...] = (
    # OpenAI's API (and vLLM's additions)
    Route("POST", "/v1/completions", completions.completions, CompletionRequest, replay=True),
    Route("POST", "/v1/chat/completions", chat.chat_completions, ChatCompletionRequest, replay=True),
    Route("POST", "/v1/embeddings", embeddings.create_embeddings, EmbeddingRequest),
    Route("POST", "/v1/responses", responses.create_response, ResponsesRequest),
    Route("POST", "/v1/score", rerank.score, ScoreRequest),
    Route("POST", "/v1/rerank", rerank.rerank, RerankRequest),
    Route("GET", "/v1/models", utility.models),
    Route("GET", "/v1/models/{model_id}", utility.model),
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
)

REPLAYABLE: tuple[str, ...] = tuple(r.path for r in ROUTES if r.replay)

API_PREFIXES = ("/v1/", "/api/")  # a path under these that no route has is still the API's (404)


@lru_cache(maxsize=4)
def _patterns(table: tuple[Route, ...]) -> list[tuple[re.Pattern[str], Route]]:
    """Each row's path as a pattern (`{name}` matches one segment), compiled once per table."""
    return [(re.compile(re.sub(r"\\\{\w+\\\}", "[^/]+", re.escape(r.path)) + "$"), r) for r in table]


def find(path: str) -> Route | None:
    """The route a request path is for (any method), or None."""
    return next((route for pattern, route in _patterns(ROUTES) if pattern.match(path)), None)


def error_shape(path: str) -> ErrorShape:
    """The error body for a request path: its route's; a path no route has (a 404, or a 401 that
    the API key gave before routing) is Ollama's under /api/ and OpenAI's elsewhere."""
    route = find(path)
    if route is not None:
        return route.errors
    return ollama_error_body if ollama.is_ollama(path) else openai_error_body


def needs_key(path: str) -> bool:
    """Whether the API key guards a path: every route but the keyless ones, and any path under
    the API's prefixes (so that probing for routes without the key learns nothing)."""
    route = find(path)
    return not route.keyless if route is not None else path.startswith(API_PREFIXES)
