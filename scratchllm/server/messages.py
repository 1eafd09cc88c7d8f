"""Chat messages, tools and response formats of the OpenAI chat-completions request.

Each message role has its own model with OpenAI's required fields, so a malformed message (a
tool message without `tool_call_id`, an assistant message with neither content nor tool calls)
is a 400 naming the field, not a prompt silently built from half a message. Content parts other
than text (images, audio, files) are refused: the models served here read text only.
"""

import json
from typing import TYPE_CHECKING, Annotated, Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Strict(BaseModel):
    """No coercion (a string where a number belongs is an error). Unknown keys are kept in
    `model_extra`, at every depth, for parse_body to name in a 400 (or log, with lenient fields)."""

    model_config = ConfigDict(strict=True, extra="allow")


class TextPart(Strict):
    type: Literal["text"]
    text: str
    prompt_cache_breakpoint: Any = None  # accepted, no effect: a caching hint


class RefusalPart(Strict):
    type: Literal["refusal"]
    refusal: str


Content = str | list[TextPart]


def _text(content: str | list[TextPart] | list[TextPart | RefusalPart] | None) -> str:
    if isinstance(content, list):
        return "".join(p.text if isinstance(p, TextPart) else p.refusal for p in content)
    return content or ""


class FunctionCall(Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(Strict):
    id: str
    type: Literal["function"]
    function: FunctionCall


class _Message(Strict):
    name: str | None = None
    if TYPE_CHECKING:  # each role's model declares its own Literal field; pydantic must not see one here
        role: str

    def text(self) -> str:
        return _text(getattr(self, "content", None))

    def template_dict(self) -> dict[str, Any]:
        """The message as a chat template reads it (developer is rendered as system)."""
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": self.text()}


class SystemMessage(_Message):
    role: Literal["system", "developer"]
    content: Content


class UserMessage(_Message):
    role: Literal["user"]
    content: Content


class AssistantMessage(_Message):
    role: Literal["assistant"]
    content: str | list[TextPart | RefusalPart] | None = None
    refusal: str | None = None
    tool_calls: list[ToolCall] | None = None
    function_call: FunctionCall | None = None
    audio: Any = None
    # not OpenAI's: the thinking of a reply from this server (or vLLM), sent back with the message
    reasoning_content: str | None = None

    @model_validator(mode="after")
    def _has_something(self) -> Self:
        # OpenAI: content is required unless tool_calls or function_call is given
        if self.content is None and not self.tool_calls and self.function_call is None:
            raise ValueError("an assistant message needs 'content' or 'tool_calls'")
        if self.audio is not None:
            raise ValueError("'audio' is not supported: this server generates text only")
        return self

    def template_dict(self) -> dict[str, Any]:
        d = super().template_dict()
        if self.reasoning_content is not None:  # Qwen3's template reads it (others ignore it)
            d["reasoning_content"] = self.reasoning_content
        calls = list(self.tool_calls or [])
        if self.function_call is not None:
            calls.append(ToolCall(id="call_0", type="function", function=self.function_call))
        if calls:
            # Chat templates (Hugging Face's convention) read arguments as a mapping.
            d["tool_calls"] = [{"id": c.id, "type": "function",
                                "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                               for c in calls]
        return d


def _arguments(text: str) -> Any:  # the JSON value, or the text itself
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return text  # not JSON: the template gets the text as the client sent it


class ToolMessage(_Message):
    role: Literal["tool"]
    content: Content
    tool_call_id: str

    def template_dict(self) -> dict[str, Any]:
        return {**super().template_dict(), "tool_call_id": self.tool_call_id}


class FunctionMessage(_Message):
    """The deprecated function-calling reply: kept because older clients still send it."""

    role: Literal["function"]
    content: str | None
    name: str

    def template_dict(self) -> dict[str, Any]:
        return {"role": "tool", "content": self.text(), "name": self.name}


ChatMessage = Annotated[SystemMessage | UserMessage | AssistantMessage | ToolMessage | FunctionMessage,
                        Field(discriminator="role")]
ROLES = ("system", "developer", "user", "assistant", "tool", "function")


# --- tools and response formats ---------------------------------------------------------------
class FunctionDefinition(Strict):
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionTool(Strict):
    type: Literal["function"]
    function: FunctionDefinition

    def spec(self) -> dict[str, Any]:
        return {"name": self.function.name, "parameters": self.function.parameters or {"type": "object"}}


class NamedFunction(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction


class AllowedTools(Strict):
    mode: Literal["auto", "required"]
    tools: list[dict[str, Any]]


class AllowedToolsChoice(Strict):
    type: Literal["allowed_tools"]
    allowed_tools: AllowedTools


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice | AllowedToolsChoice


class JSONSchemaFormat(Strict):
    name: Annotated[str, Field(min_length=1, max_length=64)]
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> Self:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type 'json_schema' needs a 'json_schema' object")
        return self
