"""The OpenAI wire format: request models, response bodies and OpenAI-style errors.

Every field of OpenAI's completions and chat-completions requests is declared here, and is one
of three kinds (docs/openai-api.md lists them all):
  implemented             it does what OpenAI documents (sampling, penalties, logit_bias,
                          response_format, tools, ...);
  refused unless neutral  a feature this server does not have (audio, store=true, ...):
                          any value but the neutral one is a 400 naming the field;
  accepted, no effect     a hint that cannot change the output (metadata, service_tier, ...).
Any other field, at any depth (a message's, a tool's), is a 400 naming it, as OpenAI's API
answers: a field the server does not know is one it cannot honour, and a client that gets text
back with HTTP 200 cannot tell. `lenient=True` (`scratchllm serve --lenient-fields`) logs them
once each at WARNING and runs the request instead, for clients that send their own extras.

Requests are parsed strictly (a string where a number belongs is an error, as OpenAI's API does,
not silently coerced); a JSON null means "the default", as the official client sends it. Every
way a request can be wrong ends as an `APIError` with a status and an OpenAI error body
``{"error": {"message", "type", "param", "code"}}``: `parse_body` (body_json.py) guards against
bodies that would make the JSON or validation layers themselves fail.
"""

import logging
import time
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Self, TypeVar, cast

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from scratchllm.errors import ConfigError
from scratchllm.server.body_json import BodyError, load_body
from scratchllm.server.errors import APIError, bad_request
from scratchllm.server.messages import ROLES, ChatMessage, FunctionTool, ResponseFormat, Strict, ToolChoice
from scratchllm.server.structured_fields import StructuredFields
from scratchllm.structured.grammar import GrammarCompiler

if TYPE_CHECKING:  # for the annotation only: sampling_params imports it where it builds one
    from scratchllm.sampling import SamplingParams

logger = logging.getLogger(__name__)

# A Retry-After hint is seconds; never tell a client to come back sooner than this.
MIN_RETRY_AFTER_S = 1
# Choices per prompt (n, best_of): the engine forks the prompt's KV blocks into that many
# sequences (one engine request each, so each also takes an admission slot).
MAX_CHOICES = 16
MAX_LOGIT_BIAS_ENTRIES = 300  # OpenAI's limit
MAX_TOP_LOGPROBS = 20  # alternatives per token (OpenAI's limit, and Ollama's)
# Unknown field names warned about so far (each once); capped so a hostile client cannot grow it.
_warned_fields: set[str] = set()
MAX_WARNED_FIELDS = 1000
MAX_NAMED_FIELDS = 8  # unknown fields a 400 lists by name (the rest are counted)

__all__ = ["APIError", "bad_request", "parse_body", "CompletionRequest", "ChatCompletionRequest",
           "EmbeddingRequest", "StreamOptions", "validate_choices", "unknown_fields",
           "refuse_unknown", "new_id", "now_s", "usage", "MIN_RETRY_AFTER_S", "MAX_TOP_LOGPROBS"]
# Fields accepted only at a neutral value: name -> (neutral values, why the rest is refused).
Refusals = dict[str, tuple[tuple[Any, ...], str]]


class StreamOptions(Strict):
    include_usage: bool = False
    include_obfuscation: bool = True  # accepted, no effect: random padding against length side channels


class _Request(Strict):
    """A top-level request: unknown fields are kept (for parse_body to name), nulls mean default."""

    model_config = ConfigDict(strict=True, extra="allow")
    REFUSED: ClassVar[Refusals] = {}

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_defaults(cls, data: Any) -> Any:
        if isinstance(data, dict):
            fields = cls.model_fields
            return {k: v for k, v in data.items() if not (v is None and k in fields)}
        return data

    def check(self) -> None:
        """After validation: refuse non-neutral values of unsupported fields."""
        for name, (neutral, why) in self.REFUSED.items():
            value = getattr(self, name)
            if not any(value == n and type(value) is type(n) for n in neutral):
                raise bad_request(f"'{name}' is not supported: {why}", param=name, code="unsupported_parameter")


def unknown_fields(model: BaseModel, path: str = "") -> list[str]:
    """The dotted paths of every field `model` (and each model inside it) did not declare."""
    found = [f"{path}{name}" for name in model.model_extra or ()]
    for name in type(model).model_fields:
        found += _unknown_in(getattr(model, name), f"{path}{name}.")
    return found


def _unknown_in(value: Any, path: str) -> list[str]:
    if isinstance(value, BaseModel):
        return unknown_fields(value, path)
    if isinstance(value, (list, tuple)):
        return [f for i, v in enumerate(value) for f in _unknown_in(v, f"{path}{i}.")]
    return []  # a free-form dict (a JSON schema, logit_bias) has no fields of ours


def refuse_unknown(names: list[str]) -> APIError:
    """OpenAI's answer to fields it does not know: 400, the names in the message, the first as param."""
    shown = ", ".join(n[:80] for n in names[:MAX_NAMED_FIELDS])
    if len(names) > MAX_NAMED_FIELDS:
        shown += f" (and {len(names) - MAX_NAMED_FIELDS} more)"
    plural = "s" if len(names) > 1 else ""
    return bad_request(f"Unrecognized request argument{plural} supplied: {shown}", param=names[0][:80],
                       code="unknown_parameter")


def _warn_unknown(name: str, where: str) -> None:
    if name in _warned_fields or len(_warned_fields) >= MAX_WARNED_FIELDS:
        return
    _warned_fields.add(name)
    logger.warning("%s: unknown field %r accepted and ignored (--lenient-fields)", where, name[:80])


class _Sampling(_Request, StructuredFields):
    """Fields both generation endpoints share. top_k, min_p, repetition_penalty, ignore_eos,
    min_tokens, stop_token_ids, skip_special_tokens, include_stop_str_in_output,
    structured_outputs and guided_* are vLLM's extensions; grammar is llama.cpp's."""

    model: str
    max_tokens: int | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)  # 0 or -1 = off
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=100.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)  # int64 or uint64; negatives wrap
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] = []
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    n: int = Field(1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted, no effect: an end-user id for the caller's own records
    timings_per_token: bool = False  # llama.cpp's option: per-token times in `timings` (server/timings.py)

    def check(self) -> None:
        super().check()
        # everything that can be refused without the model is refused at parse time
        self.stop_list()
        self.logit_bias_pairs(None)
        self.constraint()

    def stop_list(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise bad_request("'stop' takes at most 4 non-empty strings", param="stop")
        return tuple(stops)

    def logit_bias_pairs(self, vocab_size: int | None) -> dict[int, float]:
        bias = self.logit_bias or {}
        if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise bad_request(f"'logit_bias' takes at most {MAX_LOGIT_BIAS_ENTRIES} entries", param="logit_bias")
        out: dict[int, float] = {}
        for key, value in bias.items():
            if not (key.isascii() and key.isdigit() and len(key) <= 9):
                raise bad_request(f"'logit_bias' keys are token ids, got {key[:40]!r}", param="logit_bias")
            token = int(key)
            if vocab_size is not None and token >= vocab_size:
                raise bad_request(f"'logit_bias' names token id {token}, outside the vocabulary [0, {vocab_size})",
                                  param="logit_bias")
            if not -100.0 <= value <= 100.0:
                raise bad_request(f"'logit_bias' values are in [-100, 100], got {value}", param="logit_bias")
            out[token] = value
        return out

    def _logprobs_k(self) -> int | None:
        raise NotImplementedError

    def _prompt_logprobs_k(self) -> int | None:
        return None

    def sampling_kwargs(self, max_tokens: int, compiler: GrammarCompiler | None = None,
                        vocab_size: int | None = None, eos_token_id: int | None = None) -> dict[str, Any]:
        """Everything SamplingParams needs from this request, with max_tokens the handler settled
        against the context. `compiler`: a scratchllm.structured.GrammarCompiler for the served
        tokenizer (needed only when the request asks for structured output); `eos_token_id`:
        the served tokenizer's, which min_tokens holds back."""
        if self.min_tokens > max_tokens:
            raise bad_request(f"'min_tokens' ({self.min_tokens}) must be <= max_tokens ({max_tokens})",
                              param="min_tokens")
        if vocab_size is not None and any(t >= vocab_size for t in self.stop_token_ids):
            raise bad_request(f"'stop_token_ids' has token ids outside the vocabulary [0, {vocab_size})",
                              param="stop_token_ids")
        eos = () if eos_token_id is None or self.ignore_eos else (eos_token_id,)
        return {"max_tokens": max_tokens, "temperature": self.temperature, "top_p": self.top_p,
                "top_k": max(self.top_k, 0), "min_p": self.min_p,
                "seed": None if self.seed is None else self.seed % 2**64, "stop": self.stop_list(),
                "stop_token_ids": tuple(self.stop_token_ids), "ignore_eos": self.ignore_eos,
                "min_tokens": self.min_tokens, "eos_token_ids": eos, "skip_special_tokens": self.skip_special_tokens,
                "include_stop_str_in_output": self.include_stop_str_in_output,
                "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
                "repetition_penalty": self.repetition_penalty, "logit_bias": self.logit_bias_pairs(vocab_size),
                "logprobs": self._logprobs_k(), "prompt_logprobs": self._prompt_logprobs_k(),
                "grammar": self.compiled_grammar(compiler)}

    def sampling_params(self, max_tokens: int, compiler: GrammarCompiler | None = None,
                        vocab_size: int | None = None, eos_token_id: int | None = None) -> "SamplingParams":
        """The request's SamplingParams, or a 400 naming what SamplingParams refused."""
        from scratchllm.sampling import SamplingParams

        try:
            return SamplingParams(**self.sampling_kwargs(max_tokens, compiler, vocab_size, eos_token_id))
        except ConfigError as err:
            raise bad_request(str(err)) from None


def validate_choices(n: int, best_of: int | None, stream: bool, max_n: int = MAX_CHOICES) -> tuple[int, int]:
    """(n, best_of) checked as OpenAI does, and against what the engine can fork (max_n)."""
    best_of = n if best_of is None else best_of
    if best_of < n:
        raise bad_request(f"'best_of' ({best_of}) must be >= 'n' ({n})", param="best_of")
    if stream and best_of > n:
        raise bad_request("'best_of' cannot be streamed: the best choice is known only at the end", param="best_of")
    for name, value in (("n", n), ("best_of", best_of)):
        if value > max_n:
            raise bad_request(f"'{name}' > {max_n} is not supported by this server", param=name,
                              code="unsupported_parameter")
    return n, best_of


class CompletionRequest(_Sampling):

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False  # the prompt's text before the completion; with logprobs, the prompt's logprobs too
    # vLLM's: the prompt's logprobs, in its own shape
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    best_of: int | None = Field(None, ge=1, le=128)
    suffix: str | None = None  # the text after the insertion point: a fill-in-the-middle prompt (server/fill.py)
    # not in OpenAI's legacy completions; here as on chat: metadata.request_class names the
    # request's class for the evaluation loop's capture and priority feedback (docs/evaluation.md)
    metadata: Any = None

    def check(self) -> None:
        super().check()
        validate_choices(self.n, self.best_of, self.stream)
        if self.max_tokens == 0 and not self.echo:
            raise bad_request("max_tokens 0 generates nothing: it is for echo (the prompt, and with logprobs its "
                              "logprobs, as lm-evaluation-harness asks)", param="max_tokens")
        if self.suffix and self.echo:
            raise bad_request("'echo' cannot be used with 'suffix': the prompt is laid out around the insertion "
                              "point, not echoed before the completion", param="echo")
        if self.max_tokens == 0 and self.stream:
            raise bad_request("max_tokens 0 cannot be streamed: there is nothing to stream after the prompt",
                              param="max_tokens")

    @property
    def echo_logprobs(self) -> bool:
        """Whether `logprobs` covers the echoed prompt's tokens too."""
        return self.echo and self.logprobs is not None

    def prompts(self) -> list[str | list[int]]:
        """The prompt(s) as a list: each a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        if not p:
            raise bad_request("'prompt' is empty", param="prompt")
        # p[0] is not an int: a list of strings or of token-id lists (mypy cannot narrow on p[0])
        return list(cast(list[str] | list[list[int]], p))

    def _logprobs_k(self) -> int | None:
        return self.logprobs

    def _prompt_logprobs_k(self) -> int | None:
        asked = [k for k in (self.prompt_logprobs, self.logprobs if self.echo else None) if k is not None]
        return max(asked) if asked else None


_NOT_AUDIO = "this server generates text only"
# Chat-template variables the server sets from the request itself (chat_template_kwargs cannot)
TEMPLATE_RESERVED = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token", "pad_token",
                               "special_tokens", "chat_template"})
_NO_REASONING = ("no model here takes a reasoning effort (Qwen3's thinking is switched by "
                 "chat_template_kwargs: {\"enable_thinking\": false})")


class ChatCompletionRequest(_Sampling):
    REFUSED: ClassVar[Refusals] = {
        "audio": ((None,), _NOT_AUDIO),
        "modalities": ((None, ["text"]), _NOT_AUDIO),
        "functions": ((None, []), "use 'tools' (the deprecated 'functions' form is not read)"),
        "function_call": ((None, "none", "auto"), "use 'tool_choice'"),
        "store": ((None, False), "completions are not stored for later retrieval"),
        "reasoning_effort": ((None,), _NO_REASONING),
        "verbosity": ((None,), "no model here takes a verbosity setting"),
        "web_search_options": ((None,), "this server has no web search"),
        "moderation": ((None,), "this server runs no moderation model"),
    }

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[FunctionTool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True  # one forced call satisfies either value
    response_format: ResponseFormat | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: extra variables for the chat template
    chat_template: str | None = None  # vLLM's: a Jinja chat template instead of the model's (sandboxed)
    # refused unless neutral (REFUSED)
    audio: Any = None
    modalities: Any = None
    functions: Any = None
    function_call: Any = None
    store: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None
    moderation: Any = None
    # accepted, no effect on the output: caching, routing and bookkeeping hints
    metadata: Any = None
    prediction: Any = None
    prompt_cache_key: Any = None
    prompt_cache_options: Any = None
    prompt_cache_retention: Any = None
    safety_identifier: Any = None
    service_tier: Any = None

    def check(self) -> None:
        super().check()
        validate_choices(self.n, None, self.stream)
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        self.tool_plan()  # a tool_choice naming no given tool is a 400 now, not after admission
        self.template_kwargs()

    def template_kwargs(self) -> dict[str, Any]:
        return template_kwargs(self.chat_template_kwargs)

    def template_messages(self) -> list[dict[str, Any]]:
        """The messages as the chat template reads them (roles, text, tool calls, tool ids)."""
        return [m.template_dict() for m in self.messages]

    def _logprobs_k(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


def template_kwargs(given: dict[str, Any] | None) -> dict[str, Any]:
    """chat_template_kwargs, checked: the names the server itself sets cannot be replaced."""
    kwargs = dict(given or {})
    taken = sorted(set(kwargs) & TEMPLATE_RESERVED)
    if taken:
        raise bad_request(f"'chat_template_kwargs' cannot set {', '.join(taken)}: the server sets it",
                          param="chat_template_kwargs")
    return kwargs


class EmbeddingRequest(_Request):
    model: str
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: str = "float"
    dimensions: int | None = None
    user: str | None = None

    @model_validator(mode="after")
    def _format(self) -> Self:
        if self.encoding_format not in ("float", "base64"):
            raise ValueError("encoding_format must be 'float' or 'base64'")
        return self

    def inputs(self) -> list[str | list[int]]:
        x = self.input
        if isinstance(x, str) or (x and isinstance(x[0], int)):
            return [x]
        if not x:
            raise bad_request("'input' is empty", param="input")
        # x[0] is not an int: a list of strings or of token-id lists (mypy cannot narrow on x[0])
        return list(cast(list[str] | list[list[int]], x))


RequestT = TypeVar("RequestT", bound=BaseModel)


def parse_body(raw: bytes, model_cls: type[RequestT], lenient: bool = False) -> RequestT:
    """Bytes of a request body -> validated request, or an APIError naming what is wrong.
    Fields the request model does not declare are a 400 naming them; `lenient`: logged instead."""
    try:
        data = load_body(raw)
    except BodyError as err:
        raise bad_request(str(err), code=err.code) from None
    try:
        req = model_cls.model_validate(data)
    except ValidationError as err:
        # The error that got deepest names the real problem: for `str | list[TextPart]` content
        # it is the list branch's "type should be 'text'", not the str branch's "not a string".
        errors = err.errors(include_url=False)
        extra = [e for e in errors if e["type"] == "extra_forbidden"]  # a model that forbids extras itself
        if extra:
            raise refuse_unknown([_param(e["loc"]) or "?" for e in extra]) from None
        first = max(errors, key=lambda e: len(e["loc"]))
        param, msg = _param(first["loc"]), first["msg"]
        if first["type"] == "union_tag_not_found":  # a message without a role
            param, msg = f"{param}.role", f"Field required (one of {', '.join(ROLES)})"
        elif first["type"] == "union_tag_invalid":
            param, msg = f"{param}.role", f"Input should be one of {', '.join(ROLES)}"
        raise bad_request(f"{param}: {msg}" if param else msg, param=param, code="invalid_value") from None
    except RecursionError:  # load_body bounds nesting; this is the last line of defence
        raise bad_request("request body is nested too deeply", code="invalid_json") from None
    unknown = unknown_fields(req)
    if unknown and not lenient:
        raise refuse_unknown(unknown)
    for name in unknown:
        _warn_unknown(name, model_cls.__name__)
    check = getattr(req, "check", None)
    if check is not None:
        check()
    return req


def _param(loc: Sequence[int | str]) -> str | None:
    """Pydantic's error location as the client's field path: union members and the message
    role tag it tried are dropped ('messages.0.tool.tool_call_id' -> 'messages.0.tool_call_id')."""
    parts: list[str] = []
    prev: int | str | None = None
    for p in loc:
        if not (_union_tag(p) or (isinstance(prev, int) and p in ROLES)):
            parts.append(str(p))
        prev = p
    return ".".join(parts) or None


def _union_tag(loc_part: int | str) -> bool:
    """Pydantic names the union member it tried ('str', 'list[int]', 'TextPart'); clients want the field."""
    if not isinstance(loc_part, str):
        return False
    return loc_part in ("str", "int", "float", "bool", "none") or "[" in loc_part or loc_part[:1].isupper() \
        or loc_part.startswith("function-") or loc_part.startswith("literal[")


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now_s() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
