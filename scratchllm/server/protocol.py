"""The OpenAI wire format: request models, response bodies and OpenAI-style errors.

Requests are parsed strictly (a string where a number belongs is an error, as OpenAI's API
does, not silently coerced) and unknown fields are ignored (clients add their own extras).
Every way a request can be wrong ends as an `APIError` with a status and an OpenAI error body
``{"error": {"message", "type", "param", "code"}}``, which the official client turns into
`openai.BadRequestError`, `NotFoundError`, ... Nothing a client sends may produce a 500.
"""

import json
import time
import uuid
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

# A Retry-After hint is seconds; never tell a client to come back sooner than this.
MIN_RETRY_AFTER_S = 1


class APIError(Exception):
    """An error the client caused (or a full queue): status + OpenAI-style body."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    """Fields both generation endpoints share. `top_k` and `ignore_eos` are vLLM-style extensions."""

    model: str
    max_tokens: int | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    n: int = Field(1, ge=1, le=1)  # one choice per request; n > 1 is refused rather than faked
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(0.0, ge=0.0, le=0.0)  # accepted only at their neutral value
    frequency_penalty: float = Field(0.0, ge=0.0, le=0.0)
    user: str | None = None

    def stop_list(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise bad_request("'stop' takes at most 4 non-empty strings", param="stop")
        return tuple(stops)


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False  # echo needs prompt logprobs: refused in the handler, not faked

    def prompts(self) -> list[str | list[int]]:
        """The prompt(s) as a list: each a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        if not p:
            raise bad_request("'prompt' is empty", param="prompt")
        return list(p)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)


class EmbeddingRequest(_Strict):
    model: str
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None

    def inputs(self) -> list[str | list[int]]:
        x = self.input
        if isinstance(x, str) or (x and isinstance(x[0], int)):
            return [x]
        if not x:
            raise bad_request("'input' is empty", param="input")
        return list(x)


def parse_body(raw: bytes, model_cls: type[BaseModel]) -> BaseModel:
    """Bytes of a request body -> validated request, or an APIError naming what is wrong."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise bad_request(f"request body is not valid UTF-8 (byte {err.start})", code="invalid_utf8") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise bad_request(f"request body is not valid JSON: {err.msg} at line {err.lineno} column {err.colno}",
                          code="invalid_json") from None
    if not isinstance(data, dict):
        raise bad_request("request body must be a JSON object", code="invalid_json")
    try:
        return model_cls.model_validate(data)
    except ValidationError as err:
        first = err.errors(include_url=False)[0]
        param = ".".join(str(p) for p in first["loc"] if not _union_tag(p)) or None
        raise bad_request(f"{param}: {first['msg']}" if param else first["msg"], param=param,
                          code="invalid_value") from None


def _union_tag(loc_part) -> bool:
    """Pydantic names the union member it tried ('str', 'list[int]', 'TextPart'); clients want the field."""
    if not isinstance(loc_part, str):
        return False
    return loc_part in ("str", "int", "float", "bool", "none") or "[" in loc_part or loc_part[:1].isupper()


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now_s() -> int:
    return int(time.time())


def timings(metrics) -> dict | None:
    """llama.cpp-style per-response timings from the engine's RequestMetrics (None if absent)."""
    if metrics is None:
        return None
    decoded = max(metrics.completion_tokens - 1, 0)  # the first token comes out of prefill
    return {
        "queue_ms": round(metrics.queue_ms, 3),
        "prefill_ms": round(metrics.prefill_ms, 3),
        "decode_ms": round(metrics.decode_ms, 3),
        "prompt_tokens": metrics.prompt_tokens,
        "completion_tokens": metrics.completion_tokens,
        "prefill_tokens_per_s": _rate(metrics.prompt_tokens, metrics.prefill_ms),
        "decode_tokens_per_s": _rate(decoded, metrics.decode_ms),
        "ttft_ms": _since(metrics.arrival, metrics.first_token),
        "e2e_ms": _since(metrics.arrival, metrics.finished),
    }


def _since(start: float, end: float | None) -> float | None:
    return None if end is None else round((end - start) * 1e3, 3)


def _rate(n: int, ms: float) -> float | None:
    return round(n / (ms / 1e3), 2) if ms > 0 and n > 0 else None


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
