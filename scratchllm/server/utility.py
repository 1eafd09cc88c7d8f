"""Routes around generation that clients and gateways expect: /tokenize, /detokenize (the
named model's own tokenizer, with its chat template; the first model's without a name),
/version, /v1/models (every served model with its state: loaded, loading or unloaded) and
/v1/models/{id}.

Request and response shapes follow vLLM's server, so tools written for it work here:
  POST /tokenize   {"model", "prompt" | "messages" (+ "tools", "chat_template_kwargs", "add_generation_prompt"),
                   "add_special_tokens"?} -> {"tokens", "count", "max_model_len"}
  POST /detokenize {"model", "tokens"} -> {"prompt"}
"""

from __future__ import annotations

from typing import Any

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field

import scratchllm
from scratchllm.server.messages import ChatMessage, FunctionTool
from scratchllm.server.protocol import bad_request, parse_body, template_kwargs
from scratchllm.server.registry import ModelEntry, models_of
from scratchllm.server.state import ServerState


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class TokenizeRequest(_Body):
    """A prompt, or a conversation with what the chat template reads of a chat request: its
    messages (every role, tool calls and tool results), `tools`, `chat_template_kwargs`."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[FunctionTool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int] = Field(max_length=1 << 20)


async def _state(request: Request, name: str | None) -> ServerState:
    registry = models_of(request)
    return await registry.generator(request, registry.default.name if name is None else name)


async def tokenize(request: Request) -> dict[str, Any]:
    req = parse_body(await request.body(), TokenizeRequest)
    state = await _state(request, req.model)
    tok = state.model.tokenizer
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("give exactly one of 'prompt' or 'messages'", param="prompt")
    if req.messages is not None:
        extra = template_kwargs(req.chat_template_kwargs)
        if req.tools is not None:  # as transformers' apply_chat_template(tools=...) passes them
            extra["tools"] = [t.model_dump(exclude_none=True) for t in req.tools]
        try:
            text = tok.apply_chat_template([m.template_dict() for m in req.messages],
                                           add_generation_prompt=req.add_generation_prompt, **extra)
        except Exception as err:  # noqa: BLE001 - a template that rejects the messages is the client's input
            raise bad_request(f"messages do not fit the chat template: {err}", param="messages") from None
        ids = tok.encode(text, add_special_tokens=False)  # the template spells its special tokens
    else:
        for name in ("tools", "chat_template_kwargs"):
            if getattr(req, name) is not None:
                raise bad_request(f"'{name}' goes with 'messages' (the chat template reads it)", param=name)
        ids = tok.encode(req.prompt or "", add_special_tokens=req.add_special_tokens)
    return {"tokens": ids, "count": len(ids), "max_model_len": state.model.max_model_len}


async def detokenize(request: Request) -> dict[str, Any]:
    req = parse_body(await request.body(), DetokenizeRequest)
    state = await _state(request, req.model)
    tok = state.model.tokenizer
    bad = [t for t in req.tokens if not 0 <= t < tok.vocab_size]
    if bad:
        raise bad_request(f"token ids must be in [0, {tok.vocab_size}); got {bad[0]}", param="tokens")
    text: str = tok.decode(req.tokens)
    return {"prompt": text}


async def version() -> dict[str, str]:
    return {"version": scratchllm.__version__}


GREEDY = {"temperature": 0, "source": "server"}  # the server's default for the chat page, as `scratchllm generate`


def model_card(entry: ModelEntry) -> dict[str, Any]:
    """OpenAI's model object, with what this server adds: the model's task, its state and length,
    and for a generation model the sampling its file recommends (`source` "model file"), else
    greedy (`source` "server"): what the chat page starts from."""
    card = {"id": entry.name, "object": "model", "created": 0, "owned_by": "scratchllm",
            "max_model_len": entry.max_len(), "task": entry.spec.task, "state": entry.status}
    if entry.spec.task == "generate":
        recommended = entry.spec.details.get("sampling")
        card["sampling_defaults"] = {**recommended, "source": "model file"} if recommended else GREEDY
    return card


async def models(request: Request) -> dict[str, Any]:
    return {"object": "list", "data": [model_card(e) for e in models_of(request).models()]}


async def model(request: Request, model_id: str) -> dict[str, Any]:
    return model_card(models_of(request).entry(model_id))
