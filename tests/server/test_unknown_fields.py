"""Fields the server does not know are refused with OpenAI's 400, on every endpoint and at
every depth; --lenient-fields logs them instead. And every field the official `openai` client
can send is declared by our request models, so a field a new client version adds shows up here
as a failing test, not as a 400 to users."""

import typing

import httpx
import openai
import openai.types.chat as chat_types
import openai.types.responses as resp_types
import pytest
from openai.types import completion_create_params, embedding_create_params
from openai.types import shared_params as shared
from openai.types.chat import completion_create_params as chat_params
from openai.types.responses import response_create_params, response_input_param
from openai.types.shared_params import response_format_json_schema
from pydantic import BaseModel

from scratchllm.server import messages
from scratchllm.server import responses_request as responses
from scratchllm.server.app import ServerConfig, create_app
from scratchllm.server.backend import fake_backend
from scratchllm.server.protocol import ChatCompletionRequest, CompletionRequest, EmbeddingRequest, StreamOptions

USER = [{"role": "user", "content": "hi"}]
BODIES = {
    "/v1/completions": {"model": "fake", "prompt": "hi", "max_tokens": 2},
    "/v1/chat/completions": {"model": "fake", "messages": USER, "max_tokens": 2},
    "/v1/embeddings": {"model": "fake-embed", "input": "hi"},
    "/v1/score": {"model": "fake-embed", "text_1": "hi", "text_2": ["a", "b"]},
    "/v1/rerank": {"model": "fake-embed", "query": "hi", "documents": ["a", "b"]},
    "/v1/responses": {"model": "fake", "input": "hi", "max_output_tokens": 2},
    "/tokenize": {"prompt": "hi"},
}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.mark.parametrize("path", list(BODIES))
def test_an_unknown_field_is_a_400_naming_it(fake_server, path):
    url, _ = fake_server
    r = httpx.post(url + path, json={**BODIES[path], "foo": 1})
    assert r.status_code == 400
    assert r.json() == {"error": {"message": "Unrecognized request argument supplied: foo",
                                  "type": "invalid_request_error", "param": "foo", "code": "unknown_parameter"}}


@pytest.mark.parametrize("path,extra,param", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi", "foo": 1}]}, "messages.0.foo"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "foo": 1}]}]},
     "messages.0.content.0.foo"),
    ("/v1/chat/completions", {"tools": [{**TOOL, "foo": 1}]}, "tools.0.foo"),
    ("/v1/chat/completions", {"tools": [{**TOOL, "function": {**TOOL["function"], "foo": 1}}]},
     "tools.0.function.foo"),
    ("/v1/chat/completions", {"stream": True, "stream_options": {"include_usage": True, "foo": 1}},
     "stream_options.foo"),
    ("/v1/completions", {"structured_outputs": {"regex": "a", "foo": 1}}, "structured_outputs.foo"),
    ("/v1/chat/completions", {"response_format": {"type": "json_object", "foo": 1}}, "response_format.foo"),
    ("/v1/responses", {"input": [{"role": "user", "content": "hi", "foo": 1}]}, "input.0.foo"),
    ("/v1/responses", {"tools": [{"type": "function", "name": "f", "foo": 1}]}, "tools.0.foo"),
    ("/v1/responses", {"text": {"format": {"type": "json_object", "foo": 1}}}, "text.format.foo"),
    ("/v1/rerank", {"documents": [{"text": "a", "foo": 1}]}, "documents.0.foo"),
])
def test_an_unknown_nested_field_is_a_400_naming_its_path(fake_server, path, extra, param):
    url, _ = fake_server
    r = httpx.post(url + path, json={**BODIES[path], **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"] == f"Unrecognized request argument supplied: {param}"


def test_several_unknown_fields_are_all_named(fake_server):
    url, _ = fake_server
    r = httpx.post(url + "/v1/completions", json={**BODIES["/v1/completions"], "foo": 1, "bar": 2})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "Unrecognized request arguments supplied: foo, bar"


def test_lenient_fields_log_and_run(serve, caplog):
    """The OpenAI endpoints; /tokenize and /detokenize (this server's own) stay strict."""
    model, embedder = fake_backend(step_ms=1.0)
    app = create_app(model, embedder, ServerConfig(lenient_fields=True))
    with serve(app) as url:
        for path, body in BODIES.items():
            if not path.startswith("/v1/"):
                continue
            r = httpx.post(url + path, json={**body, "x_lenient_probe": 1,
                                             **({"messages": [{**USER[0], "x_nested_probe": 1}]}
                                                if "messages" in body else {})})
            assert r.status_code == 200, (path, r.text)
    logged = " ".join(r.getMessage() for r in caplog.records)
    assert "x_lenient_probe" in logged and "messages.0.x_nested_probe" in logged


def test_the_openai_client_extra_body_reaches_the_extension_fields(fake_server):
    url, _ = fake_server
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=20)
    out = client.completions.create(model="fake", prompt="hi", max_tokens=4, temperature=0,
                                    extra_body={"min_tokens": 2, "stop_token_ids": [3], "skip_special_tokens": False,
                                                "include_stop_str_in_output": True, "top_k": 5})
    assert out.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="fake", messages=USER, max_tokens=2, extra_body={"not_a_field": 1})
    assert info.value.body["param"] == "not_a_field"  # type: ignore[index]


# --- every field of the openai client's param types is declared -------------------------------
def declared(model: type[BaseModel]) -> set[str]:
    return {f.alias or name for name, f in model.model_fields.items()}


def keys(typed_dict: type) -> set[str]:
    return set(typing.get_type_hints(typed_dict))


PAIRS = [
    (chat_params.CompletionCreateParamsBase, ChatCompletionRequest),
    (completion_create_params.CompletionCreateParamsBase, CompletionRequest),
    (embedding_create_params.EmbeddingCreateParams, EmbeddingRequest),
    (chat_types.ChatCompletionStreamOptionsParam, StreamOptions),
    (chat_types.ChatCompletionSystemMessageParam, messages.SystemMessage),
    (chat_types.ChatCompletionDeveloperMessageParam, messages.SystemMessage),
    (chat_types.ChatCompletionUserMessageParam, messages.UserMessage),
    (chat_types.ChatCompletionAssistantMessageParam, messages.AssistantMessage),
    (chat_types.ChatCompletionToolMessageParam, messages.ToolMessage),
    (chat_types.ChatCompletionFunctionMessageParam, messages.FunctionMessage),
    (chat_types.ChatCompletionContentPartTextParam, messages.TextPart),
    (chat_types.ChatCompletionContentPartRefusalParam, messages.RefusalPart),
    (chat_types.ChatCompletionMessageFunctionToolCallParam, messages.ToolCall),
    (chat_types.chat_completion_message_function_tool_call_param.Function, messages.FunctionCall),
    (chat_types.ChatCompletionFunctionToolParam, messages.FunctionTool),
    (shared.FunctionDefinition, messages.FunctionDefinition),
    (chat_types.ChatCompletionNamedToolChoiceParam, messages.NamedToolChoice),
    (chat_types.ChatCompletionAllowedToolChoiceParam, messages.AllowedToolsChoice),
    (chat_types.ChatCompletionAllowedToolsParam, messages.AllowedTools),
    (shared.ResponseFormatJSONSchema, messages.ResponseFormat),
    (response_format_json_schema.JSONSchema, messages.JSONSchemaFormat),
    (response_create_params.ResponseCreateParamsBase, responses.ResponsesRequest),
    (resp_types.EasyInputMessageParam, responses.MessageItem),
    (response_input_param.Message, responses.MessageItem),
    (resp_types.ResponseOutputMessageParam, responses.MessageItem),
    (resp_types.ResponseInputTextParam, responses.InputText),
    (resp_types.ResponseOutputTextParam, responses.InputText),
    (resp_types.ResponseFunctionToolCallParam, responses.FunctionCallItem),
    (response_input_param.FunctionCallOutput, responses.FunctionCallOutputItem),
    (resp_types.ResponseReasoningItemParam, responses.ReasoningItem),
    (resp_types.FunctionToolParam, responses.ResponsesFunctionTool),
    (resp_types.ToolChoiceFunctionParam, responses.ResponsesNamedFunction),
    (resp_types.ToolChoiceAllowedParam, responses.ResponsesAllowedTools),
    (resp_types.ResponseTextConfigParam, responses.TextConfig),
    (resp_types.ResponseFormatTextJSONSchemaConfigParam, responses.TextFormat),
]


@pytest.mark.parametrize("params,model", PAIRS, ids=[p.__name__ for p, _ in PAIRS])
def test_every_openai_client_field_is_declared(params, model):
    missing = keys(params) - declared(model)
    assert not missing, f"{model.__name__} does not declare {sorted(missing)} (openai's {params.__name__})"
