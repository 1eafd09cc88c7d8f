"""Anthropic's Messages API wire format: the request (every field of the `anthropic` client's
MessageCreateParams, and the sampling fields older clients send), its content blocks, and
Anthropic's error body. The translation into the chat request this server runs:
anthropic_translate.py.

Content blocks are checked here, each by its type: image, document and the server tools' blocks
are refused by name (the models served here read text and run no server tools), and a block's
unknown field is refused by its path like any other.
"""

import re
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, Field, ValidationError, model_validator

from scratchllm.server.errors import APIError, bad_request
from scratchllm.server.messages import Strict
from scratchllm.server.protocol import Refusals, _Request, unknown_fields

# Blocks a request may carry that name a feature this server does not have: refused by type.
REFUSED_BLOCKS = {
    "image": "the models served here read text only", "document": "the models served here read text only",
    "search_result": "search results are not supported", "redacted_thinking": "its thinking cannot be read back",
    "container_upload": "this server runs no code containers", "tool_reference": "tool search is not available",
    "browser_state": "this server runs no server tools",
}
SERVER_TOOL_BLOCK = re.compile(r"^(server_tool_use|\w+_tool_result)$")  # web search, code execution, ...
DATE = re.compile(r"^\d{4}-\d{2}-\d{2}$")
# Anthropic's error types by HTTP status (its API reference's "Errors")
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 499: "invalid_request_error",
               503: "overloaded_error", 529: "overloaded_error"}


class CacheControl(Strict):
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class _Block(Strict):
    cache_control: CacheControl | None = None  # accepted, no effect: prefix caching here is automatic


class TextBlockIn(_Block):
    type: Literal["text"]
    text: str
    citations: list[Any] | None = None


class ThinkingBlockIn(Strict):
    type: Literal["thinking"]
    thinking: str
    signature: str  # accepted as sent: signatures here are not checked


class ToolUseBlockIn(_Block):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    toolset_name: str | None = None
    caller: dict[str, Any] | None = None  # who made the call: only the model itself ("direct") here


class ToolResultBlockIn(_Block):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[dict[str, Any]] | None = None
    is_error: bool = False  # accepted: the model reads the failure from the result's text
    toolset_name: str | None = None


BLOCKS: dict[str, type[Strict]] = {"text": TextBlockIn, "thinking": ThinkingBlockIn, "tool_use": ToolUseBlockIn,
                                   "tool_result": ToolResultBlockIn}


class Turn(Strict):
    role: Literal["user", "assistant", "system"]
    content: str | list[dict[str, Any]]


class ToolIn(Strict):
    """A client tool. Server tools (web search, code execution, ...) are refused by their type."""

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    input_schema: dict[str, Any]
    description: str | None = None
    type: Literal["custom"] | None = None
    strict: bool | None = None
    cache_control: CacheControl | None = None  # accepted, no effect
    eager_input_streaming: bool | None = None  # accepted, no effect: arguments stream as written anyway
    defer_loading: bool = False
    input_examples: list[dict[str, Any]] | None = None
    allowed_callers: list[str] | None = None

    @model_validator(mode="before")
    @classmethod
    def _client_tools_only(cls, data: Any) -> Any:
        kind = data.get("type") if isinstance(data, dict) else None
        if isinstance(kind, str) and kind != "custom":
            raise ValueError(f"'{kind}' is a server tool; this server runs client tools only (type \"custom\")")
        return data


class ToolChoiceIn(Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class ThinkingIn(Strict):
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: int | None = None
    display: Literal["summarized", "omitted"] | None = None


class OutputFormat(Strict):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(Strict):
    effort: str | None = None
    format: OutputFormat | None = None


class MetadataIn(Strict):
    user_id: str | None = None  # accepted, no effect


class MessagesBody(_Request):
    """The fields MessageCreateParams and MessageCountTokensParams share."""

    REFUSED: ClassVar[Refusals] = {
        "container": ((None,), "this server runs no code containers"),
        "diagnostics": ((None,), "no cache diagnostics are kept"),
    }

    model: str
    messages: list[Turn] = Field(min_length=1)
    system: str | list[TextBlockIn] | None = None
    tools: list[ToolIn] | None = None
    tool_choice: ToolChoiceIn | None = None
    thinking: ThinkingIn | None = None
    output_config: OutputConfig | None = None
    # accepted, no effect: caching, routing and bookkeeping
    cache_control: CacheControl | None = None
    speed: Literal["standard", "fast"] | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None
    container: Any = None
    diagnostics: Any = None

    def check(self) -> None:
        super().check()
        for i, turn in enumerate(self.messages):
            if isinstance(turn.content, list):
                for j, block in enumerate(turn.content):
                    read_block(block, f"messages.{i}.content.{j}", turn.role)
        for i, tool in enumerate(self.tools or []):
            for name, neutral in (("defer_loading", (False,)), ("input_examples", (None, [])),
                                  ("allowed_callers", (None, ["direct"]))):
                if getattr(tool, name) not in neutral:
                    raise bad_request(f"'tools.{i}.{name}' is not supported: the tools here are always in the "
                                      "prompt, called by the model, and shown without examples",
                                      param=f"tools.{i}.{name}", code="unsupported_parameter")
        effort = self.output_config.effort if self.output_config else None
        if effort is not None:
            raise bad_request("'output_config.effort' is not supported: no model here takes an effort level",
                              param="output_config.effort", code="unsupported_parameter")


class AnthropicCountRequest(MessagesBody):
    """POST /v1/messages/count_tokens."""


class AnthropicRequest(MessagesBody):
    """POST /v1/messages."""

    max_tokens: int = Field(ge=0)
    stream: bool = False
    stop_sequences: list[str] | None = None
    temperature: float = Field(1.0, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    metadata: MetadataIn | None = None
    service_tier: Literal["auto", "standard_only"] | None = None  # accepted, no effect: one tier
    inference_geo: str | None = None  # accepted, no effect: one place


def read_block(raw: dict[str, Any], path: str, role: str) -> BaseModel:
    """One content block, checked by its type: refused by name, or validated and its unknown
    fields refused by their path."""
    kind = raw.get("type")
    if kind in REFUSED_BLOCKS or (isinstance(kind, str) and SERVER_TOOL_BLOCK.match(kind) and kind != "tool_result"):
        why = REFUSED_BLOCKS.get(kind, "this server runs no server tools")
        raise bad_request(f"'{kind}' content blocks are not supported: {why}", param=f"{path}.type",
                          code="unsupported_parameter")
    model = BLOCKS.get(kind) if isinstance(kind, str) else None
    if model is None:
        raise bad_request(f"{path}.type: a content block is one of {', '.join(BLOCKS)}, got {kind!r}",
                          param=f"{path}.type")
    try:
        block = model.model_validate(raw)
    except ValidationError as err:
        first = err.errors(include_url=False)[0]
        where = ".".join([path, *map(str, first["loc"])])
        raise bad_request(f"{where}: {first['msg']}", param=where) from None
    unknown = unknown_fields(block, f"{path}.")
    if unknown:
        raise bad_request(f"Unrecognized request argument supplied: {unknown[0]}", param=unknown[0],
                          code="unknown_parameter")
    allowed = {"user": ("text", "tool_result"), "assistant": ("text", "thinking", "tool_use"), "system": ("text",)}
    if kind not in allowed[role]:
        raise bad_request(f"a {role} turn cannot hold '{kind}' blocks", param=f"{path}.type")
    if isinstance(block, ToolUseBlockIn) and block.caller not in (None, {"type": "direct"}):
        raise bad_request("only the model's own calls (caller type \"direct\") are read here",
                          param=f"{path}.caller", code="unsupported_parameter")
    if isinstance(block, TextBlockIn) and block.citations:
        raise bad_request("citations are not supported", param=f"{path}.citations", code="unsupported_parameter")
    if isinstance(block, ToolResultBlockIn) and isinstance(block.content, list):
        for k, part in enumerate(block.content):
            read_block(part, f"{path}.content.{k}", "system")  # text only
    return block


def anthropic_error_body(err: APIError) -> dict[str, Any]:
    """Anthropic's error body: {"type": "error", "error": {"type", "message"}}."""
    kind = ERROR_TYPES.get(err.status, "api_error" if err.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": err.message}}


def check_version(version: str | None) -> None:
    """The anthropic-version header: any date-shaped version (this server serves one API)."""
    if version is not None and not DATE.match(version):
        raise bad_request(f"anthropic-version must be a date like 2023-06-01, got {version[:40]!r}",
                          param="anthropic-version")
