"""Ollama's wire format: its request bodies, their `options`, and its reply fields.

An Ollama request is translated into the OpenAI request this server already runs (protocol.py),
so both APIs share one pipeline: validation, the chat template, structured output, sampling.

`options` (Ollama's names -> ours):
  sampling        temperature, top_p, top_k, min_p, seed, stop; repeat_penalty -> repetition_penalty,
                  presence_penalty, frequency_penalty; num_predict -> max_tokens (-1 and -2: to the
                  end of the context)
  context         num_ctx: the request's context (prompt + output) in tokens, at most the model's
  neutral only    typical_p 1, tfs_z 1, mirostat 0, penalize_newline true, repeat_last_n -1 (our
                  repeat_penalty reads the whole context): any other value is refused
  no effect       num_keep (the context is never shifted here), mirostat_tau and mirostat_eta
                  (mirostat is off), and how Ollama loads a model (numa, num_batch, num_gpu,
                  main_gpu, low_vram, f16_kv, logits_all, vocab_only, use_mmap, use_mlock,
                  embedding_only, num_thread): `serve`'s own flags decide that here
Any other option is refused. Options not given take this server's defaults (temperature 1, no
top-k or top-p, no penalty), not the defaults an Ollama model file would set.

`format`: "json" is any JSON object, a JSON schema is that schema (both through the grammar).
`logprobs` / `top_logprobs` (0 to 20): each reply line's `logprobs`, entries of OpenAI chat's shape.
Errors are Ollama's shape, `{"error": "..."}`, with the HTTP status OpenAI's API would use.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
from typing import Any

from pydantic import Field

from scratchllm.engine.protocol import RequestMetrics
from scratchllm.server.errors import APIError, bad_request
from scratchllm.server.messages import Strict
from scratchllm.server.protocol import MAX_TOP_LOGPROBS, refuse_unknown, unknown_fields

SAMPLING = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "seed": "seed",
            "stop": "stop", "repeat_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
            "frequency_penalty": "frequency_penalty"}
NEUTRAL = {"typical_p": (1.0,), "tfs_z": (1.0,), "mirostat": (0,), "penalize_newline": (True,),
           "repeat_last_n": (-1,)}
NO_EFFECT = frozenset({"num_keep", "mirostat_tau", "mirostat_eta", "numa", "num_batch", "num_gpu", "main_gpu",
                       "low_vram", "f16_kv", "logits_all", "vocab_only", "use_mmap", "use_mlock", "embedding_only",
                       "num_thread"})
GENERATION_ONLY = frozenset({*SAMPLING, *NEUTRAL, "num_predict", "num_ctx"})
FOREVER = "9999-12-31T23:59:59Z"  # /api/ps's expires_at of a model kept loaded until the server stops


class _OllamaBody(Strict):
    model: str = Field(min_length=1)
    keep_alive: float | str | None = None
    options: dict[str, Any] | None = None


class OllamaGenerateRequest(_OllamaBody):
    prompt: str | None = None
    system: str | None = None
    suffix: str | None = None
    template: str | None = None
    context: list[int] | None = None
    raw: bool = False
    stream: bool = True
    format: str | dict[str, Any] | None = None
    images: list[Any] | None = None
    think: bool | str | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None


class OllamaMessage(Strict):
    role: str
    content: str = ""
    images: list[Any] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_name: str | None = None
    thinking: str | None = None


class OllamaChatRequest(_OllamaBody):
    messages: list[OllamaMessage] = []
    tools: list[dict[str, Any]] | None = None
    stream: bool = True
    format: str | dict[str, Any] | None = None
    think: bool | str | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None


class OllamaEmbedRequest(_OllamaBody):
    input: str | list[str]
    truncate: bool = True
    dimensions: int | None = None


class OllamaEmbeddingsRequest(_OllamaBody):
    prompt: str


class OllamaShowRequest(Strict):
    model: str | None = None
    name: str | None = None  # the older spelling
    verbose: bool = False


def check_unknown(req: Strict, lenient: bool) -> None:
    unknown = unknown_fields(req)
    if unknown and not lenient:
        raise refuse_unknown(unknown)


def refuse_unsupported(req: OllamaGenerateRequest | OllamaChatRequest) -> None:
    """Fields of a generation request that this server cannot honour, refused by name."""
    if req.think not in (None, False):
        raise bad_request("'think' is not supported: the models served here do not reason in a separate channel",
                          param="think")
    images = req.images if isinstance(req, OllamaGenerateRequest) else [i for m in req.messages for i in m.images or ()]
    if images:
        raise bad_request("'images' is not supported: the models served here read text only", param="images")
    if isinstance(req, OllamaGenerateRequest):
        if req.template:
            raise bad_request("'template' is not supported: the model's own chat template is used (or 'raw': true "
                              "for none)", param="template")
        for name in ("raw", "system", "context"):
            if req.suffix and getattr(req, name):
                raise bad_request(f"'{name}' cannot be used with 'suffix': the prompt is the model's "
                                  f"fill-in-the-middle layout of 'prompt' and 'suffix'", param=name)


def openai_fields(options: dict[str, Any] | None, format: str | dict[str, Any] | None) -> dict[str, Any]:
    """`options` and `format` as OpenAI request fields, plus "num_ctx" when given (the caller
    settles it against the model). Unknown or non-neutral options are a 400 naming them."""
    out: dict[str, Any] = {}
    for name, value in (options or {}).items():
        if name in SAMPLING:
            out[SAMPLING[name]] = [value] if name == "stop" and isinstance(value, str) else value
        elif name == "num_predict":
            if not isinstance(value, int) or isinstance(value, bool) or value == 0 or value < -2:
                raise bad_request(f"options.num_predict must be a positive number of tokens, or -1 (to the end of "
                                  f"the context), got {value!r}", param="options.num_predict")
            if value > 0:
                out["max_tokens"] = value
        elif name == "num_ctx":
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise bad_request(f"options.num_ctx must be a positive number of tokens, got {value!r}",
                                  param="options.num_ctx")
            out["num_ctx"] = value
        elif name in NEUTRAL:
            if not any(value == n and isinstance(value, type(n)) for n in NEUTRAL[name]) \
                    and not (isinstance(value, int | float) and not isinstance(value, bool) and value in NEUTRAL[name]):
                raise bad_request(f"options.{name} = {value!r} is not supported (only {NEUTRAL[name][0]!r}: "
                                  f"{_why_neutral(name)})", param=f"options.{name}")
        elif name not in NO_EFFECT:
            raise bad_request(f"unknown option '{name}'; the options this server takes: "
                              + ", ".join(sorted({*SAMPLING, *NEUTRAL, *NO_EFFECT, "num_predict", "num_ctx"})),
                              param=f"options.{name}")
    if format == "json":
        out["structured_outputs"] = {"json_object": True}
    elif isinstance(format, dict):
        out["structured_outputs"] = {"json": format}
    elif format not in (None, ""):
        raise bad_request(f"'format' is \"json\" or a JSON schema, got {format!r}", param="format")
    return out


def logprob_fields(req: OllamaGenerateRequest | OllamaChatRequest) -> dict[str, Any]:
    """`logprobs` and `top_logprobs` as the translated request's fields (chat's or completions'
    spelling). As Ollama reads them: top_logprobs is checked whether or not logprobs is asked
    for, and without `"logprobs": true` it asks for nothing."""
    k = req.top_logprobs
    if k is not None and not 0 <= k <= MAX_TOP_LOGPROBS:
        raise bad_request(f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {k}", param="top_logprobs")
    if not req.logprobs:
        return {}
    if isinstance(req, OllamaChatRequest):
        return {"logprobs": True, "top_logprobs": k or 0}
    return {"logprobs": k or 0}


def _why_neutral(name: str) -> str:
    return {"repeat_last_n": "repeat_penalty here reads the whole context",
            "penalize_newline": "repeat_penalty here applies to every token",
            "mirostat": "mirostat sampling is not implemented"}.get(name, "this sampler is not implemented")


def embed_options(options: dict[str, Any] | None) -> None:
    """An embedding request takes the options that do not change a generation's output only."""
    for name in options or {}:
        if name in GENERATION_ONLY:
            raise bad_request(f"options.{name} does not apply to embeddings", param=f"options.{name}")
    openai_fields({k: v for k, v in (options or {}).items() if k not in GENERATION_ONLY}, None)


def ollama_param(param: str | None) -> str | None:
    """An OpenAI field name in an error, as the Ollama request spelled it."""
    reverse = {v: k for k, v in SAMPLING.items()} | {"max_tokens": "num_predict"}
    head = (param or "").split(".")[0]
    return f"options.{reverse[head]}" if head in reverse else param


def renamed(err: APIError) -> APIError:
    param = ollama_param(err.param)
    if param != err.param and err.param:
        return APIError(err.status, err.message.replace(err.param, param or ""), err.type, param, err.code,
                        err.headers)
    return err


def openai_messages(messages: list[OllamaMessage]) -> list[dict[str, Any]]:
    """Ollama's chat messages as OpenAI's: tool calls get ids (Ollama's have none) and a tool
    reply names the call by its function's name."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        msg: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.tool_calls:
            calls = []
            for j, call in enumerate(m.tool_calls):
                function = call.get("function") if isinstance(call, dict) else None
                if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                    raise bad_request("a tool call is {\"function\": {\"name\": ..., \"arguments\": {...}}}",
                                      param=f"messages.{i}.tool_calls.{j}")
                calls.append({"id": f"call_{i}_{j}", "type": "function",
                              "function": {"name": function["name"],
                                           "arguments": json.dumps(function.get("arguments", {}))}})
            msg["tool_calls"] = calls
        if m.role == "tool":
            msg["tool_call_id"] = m.tool_name or "call"
        out.append(msg)
    return out


def ollama_tool_calls(openai_calls: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """OpenAI tool calls (arguments as JSON text) as Ollama's (arguments as an object)."""
    if not openai_calls:
        return None
    calls = []
    for call in openai_calls:
        try:
            arguments = json.loads(call["function"]["arguments"])
        except (ValueError, RecursionError):
            arguments = {}
        calls.append({"function": {"name": call["function"]["name"], "arguments": arguments}})
    return calls


def timestamp(seconds: float | None = None) -> str:
    """RFC 3339 in UTC, as Ollama writes created_at."""
    when = dt.datetime.fromtimestamp(seconds, dt.UTC) if seconds is not None else dt.datetime.now(dt.UTC)
    return when.isoformat().replace("+00:00", "Z")


def durations(metrics: RequestMetrics | None, load_s: float) -> dict[str, Any]:
    """Ollama's counts and nanosecond durations from the engine's own RequestMetrics."""
    out: dict[str, Any] = {"load_duration": int(load_s * 1e9)}
    if metrics is None:
        return out
    ns = 1_000_000
    total = (metrics.finished - metrics.arrival) if metrics.finished is not None else 0.0
    return {**out, "total_duration": int((total + load_s) * 1e9), "prompt_eval_count": metrics.prompt_tokens,
            "prompt_eval_duration": int(max(metrics.queue_ms + metrics.prefill_ms, 0.0) * ns),
            "eval_count": metrics.completion_tokens, "eval_duration": int(max(metrics.decode_ms, 0.0) * ns)}


def model_details(details: dict[str, Any]) -> dict[str, Any]:
    """Ollama's `details` of a model from what its header says (engine/shared_memory_plan.py)."""
    family = str(details.get("family", ""))
    return {"parent_model": "", "format": details.get("format", ""), "family": family,
            "families": [family] if family else None, "parameter_size": _count(details.get("parameters")),
            "quantization_level": details.get("quantization", "")}


def _count(n: Any) -> str:
    if not isinstance(n, int) or n <= 0:
        return ""
    for unit, size in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)


def digest(name: str, details: dict[str, Any]) -> str:
    """An identity of the model's file as it is now (its path, size and modification time), not a
    hash of its bytes: a model list must not read gigabytes to answer."""
    key = f"{name}\0{details.get('path', '')}\0{details.get('size', 0)}\0{details.get('mtime', 0)}"
    return hashlib.sha256(key.encode()).hexdigest()


def error_body(err: APIError) -> dict[str, Any]:
    return {"error": renamed(err).message}
