"""The /v1/responses request: OpenAI's Responses fields, declared one by one like the chat
request's (protocol.py), and the same request as a chat completion (`chat_request`): the input
items become chat messages, the tools and tool choice chat's, `text.format` a response_format.
"""

from typing import Annotated, Any, ClassVar, Literal

from pydantic import Discriminator, Field, Tag, ValidationError

from scratchllm.server.messages import Strict
from scratchllm.server.protocol import ChatCompletionRequest, Refusals, StreamOptions, _Request, bad_request

_STATELESS = "this server stores nothing between requests: send the whole conversation as 'input'"


class InputText(Strict):
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None  # an output_text sent back: accepted, no effect
    logprobs: list[Any] | None = None  # as above
    prompt_cache_breakpoint: Any = None  # accepted, no effect: a caching hint


class Refusal(Strict):
    type: Literal["refusal"]
    refusal: str


class MessageItem(Strict):
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputText | Refusal]
    type: Literal["message"] = "message"
    id: str | None = None
    status: str | None = None
    phase: str | None = None  # accepted, no effect

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text if isinstance(p, InputText) else p.refusal for p in self.content)


class FunctionCallItem(Strict):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None
    # accepted, no effect: how the client's own program made or ran the call
    namespace: str | None = None
    caller: Any = None
    async_: Any = Field(None, alias="async")


class FunctionCallOutputItem(Strict):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputText]
    id: str | None = None
    status: str | None = None
    # accepted, no effect: the call is matched by call_id
    name: str | None = None
    namespace: str | None = None
    caller: Any = None


class ReasoningText(Strict):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(Strict):
    type: Literal["reasoning"]
    summary: list[ReasoningText] = []
    content: list[ReasoningText] | None = None
    id: str | None = None
    status: str | None = None
    encrypted_content: str | None = None  # refused unless null (ChatCompletionRequest has no such thing)


def _item_kind(item: Any) -> str:
    kind = item.get("type", "message") if isinstance(item, dict) else getattr(item, "type", "message")
    return kind if kind in ("function_call", "function_call_output", "reasoning") else "message"


InputItem = Annotated[Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
                      | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
                      | Annotated[ReasoningItem, Tag("reasoning")], Discriminator(_item_kind)]


class ResponsesFunctionTool(Strict):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    # accepted, no effect: every tool is shown at once, to the model alone, whatever it returns
    defer_loading: bool | None = None
    allowed_callers: Any = None
    async_: Any = Field(None, alias="async")
    output_schema: Any = None

    def chat(self) -> dict[str, Any]:
        fn = {k: v for k, v in {"name": self.name, "description": self.description, "parameters": self.parameters,
                                "strict": self.strict}.items() if v is not None}
        return {"type": "function", "function": fn}


class ResponsesNamedFunction(Strict):
    type: Literal["function"]
    name: str


class ResponsesAllowedTools(Strict):
    type: Literal["allowed_tools"]
    mode: Literal["auto", "required"]
    tools: list[dict[str, Any]]


class TextFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(Strict):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None  # "medium" (the default) is neutral: no model here has another


class ResponsesRequest(_Request):
    REFUSED: ClassVar[Refusals] = {
        "store": ((None, False), _STATELESS),
        "previous_response_id": ((None,), _STATELESS),
        "conversation": ((None,), _STATELESS),
        "background": ((None, False), "responses are answered while the request waits"),
        "background_options": ((None,), "responses are answered while the request waits"),
        "context_management": ((None,), "the input is used as sent"),
        "include": ((None, []), "no extra output data is available"),
        "max_tool_calls": ((None,), "there are no built-in tools"),
        "prompt": ((None,), "there are no stored prompt templates"),
        "reasoning": ((None,), "the models served here take no reasoning settings"),
        "top_logprobs": ((None, 0), "output logprobs are not returned here; use /v1/chat/completions"),
        "truncation": ((None, "disabled"), "the input is not truncated"),
        "image": ((None,), "this server generates text only"),
        "moderation": ((None,), "this server runs no moderation model"),
        "access_programs": ((None,), "there are no access programs"),
    }

    model: str
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[ResponsesFunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ResponsesNamedFunction | ResponsesAllowedTools | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    # refused unless neutral (REFUSED)
    store: Any = None
    previous_response_id: Any = None
    conversation: Any = None
    background: Any = None
    background_options: Any = None
    context_management: Any = None
    include: Any = None
    max_tool_calls: Any = None
    prompt: Any = None
    reasoning: Any = None
    top_logprobs: Any = None
    truncation: Any = None
    image: Any = None
    moderation: Any = None
    access_programs: Any = None
    # accepted, no effect: bookkeeping, caching and routing hints
    metadata: dict[str, str] | None = None
    prompt_cache_key: Any = None
    prompt_cache_options: Any = None
    prompt_cache_retention: Any = None
    safety_identifier: Any = None
    service_tier: Any = None
    user: Any = None

    def check(self) -> None:
        super().check()
        for item in self.input if isinstance(self.input, list) else []:
            if isinstance(item, ReasoningItem) and item.encrypted_content is not None:
                raise bad_request("'encrypted_content' of a reasoning item is not supported: no model here "
                                  "encrypts its reasoning", param="input", code="unsupported_parameter")

    def chat_request(self) -> ChatCompletionRequest:
        """The same request as a chat completion (a 400 naming `input` if it cannot be one)."""
        body: dict[str, Any] = {"model": self.model, "messages": self.messages(), "temperature": self.temperature,
                                "top_p": self.top_p, "parallel_tool_calls": self.parallel_tool_calls}
        if self.max_output_tokens is not None:
            body["max_completion_tokens"] = self.max_output_tokens
        if self.tools:
            body["tools"] = [t.chat() for t in self.tools]
        choice = self.tool_choice
        if isinstance(choice, ResponsesNamedFunction):
            body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        elif isinstance(choice, ResponsesAllowedTools):
            body["tool_choice"] = {"type": "allowed_tools", "allowed_tools": {"mode": choice.mode, "tools": [
                {"type": "function", "function": {"name": t.get("name")}} for t in choice.tools]}}
        elif choice is not None:
            body["tool_choice"] = choice
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type == "json_schema":
            schema = {k: v for k, v in {"name": fmt.name or "output", "schema": fmt.schema_,
                                        "description": fmt.description, "strict": fmt.strict}.items() if v is not None}
            body["response_format"] = {"type": "json_schema", "json_schema": schema}
        elif fmt is not None:
            body["response_format"] = {"type": fmt.type}
        try:
            req = ChatCompletionRequest.model_validate(body)
        except ValidationError as err:
            first = err.errors(include_url=False)[0]
            raise bad_request(f"the input is not a conversation this server can run: {first['msg']}",
                              param="input") from None
        req.check()
        return req

    def messages(self) -> list[dict[str, Any]]:
        """The chat messages: instructions, then the input's items in order (a function call joins
        the assistant message before it; reasoning goes with the assistant message after it)."""
        out: list[dict[str, Any]] = [{"role": "system", "content": self.instructions}] if self.instructions else []
        if isinstance(self.input, str):
            return [*out, {"role": "user", "content": self.input}]
        thought: str | None = None
        for item in self.input:
            if isinstance(item, ReasoningItem):
                thought = "".join(p.text for p in (item.content or item.summary))
            elif isinstance(item, MessageItem):
                msg: dict[str, Any] = {"role": item.role, "content": item.text()}
                if item.role == "assistant" and thought is not None:
                    msg["reasoning_content"], thought = thought, None
                out.append(msg)
            elif isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                last = out[-1] if out else None
                if last is not None and last["role"] == "assistant":
                    last.setdefault("tool_calls", []).append(call)
                else:
                    out.append({"role": "assistant", "content": None, "tool_calls": [call],
                                **({"reasoning_content": thought} if thought is not None else {})})
                    thought = None
            else:
                output = item.output if isinstance(item.output, str) else "".join(p.text for p in item.output)
                out.append({"role": "tool", "tool_call_id": item.call_id, "content": output})
        return out
