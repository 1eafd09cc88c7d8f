"""POST /v1/responses: OpenAI's Responses API, stateless. The request becomes a chat request
(its messages, tools, tool choice and text format) and runs the chat pipeline (chat.prepare);
the reply comes back as Responses output items (responses_output.py), whole or as the
Responses stream's events.

  input          a string (one user message) or items: messages (roles user, system,
                 developer, assistant; text parts), `function_call` items and their
                 `function_call_output`s (a tool loop sent back whole), `reasoning` items
  instructions   a system message before the input
  tools          function tools (`{"type": "function", "name", "parameters", ...}`)
  text.format    text, json_object or json_schema: structured output as on chat
Nothing is stored: `store: true`, `previous_response_id`, `conversation` and `background` are
400s naming the field (send the whole conversation as `input` instead).
"""

from typing import Any

from fastapi import Request
from fastapi.responses import Response

from scratchllm.engine.protocol import RequestMetrics
from scratchllm.server import chat
from scratchllm.server.generation import EventStream, Generation
from scratchllm.server.protocol import new_id, now_s, parse_body
from scratchllm.server.registry import models_of
from scratchllm.server.responses_output import OutputBuilder, stream_events
from scratchllm.server.responses_request import ResponsesRequest


def response_body(head: dict[str, Any], req: ResponsesRequest, output: list[dict[str, Any]], finish: str | None,
                  prompt_tokens: int, output_tokens: int, metrics: RequestMetrics | None) -> dict[str, Any]:
    """The Response object: `finish` None while it is in progress."""
    status = "in_progress" if finish is None else "incomplete" if finish in ("length", "abort") else "completed"
    cached = metrics.cached_tokens if metrics is not None else 0
    usage = None if finish is None else {
        "input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt_tokens + output_tokens}
    fmt = req.text.format if req.text is not None and req.text.format is not None else None
    return {
        "id": head["id"], "object": "response", "created_at": head["created_at"], "status": status,
        "completed_at": head["created_at"] if status == "completed" else None, "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if finish == "length" else None,
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "model": head["model"],
        "output": output, "parallel_tool_calls": req.parallel_tool_calls, "previous_response_id": None,
        "reasoning": {"effort": None, "summary": None}, "store": False, "temperature": req.temperature,
        "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
        "tool_choice": _tool_choice(req),
        "tools": [t.model_dump(exclude_none=True) for t in req.tools or []], "top_p": req.top_p,
        "truncation": "disabled", "usage": usage, "metadata": req.metadata or {}, "background": False,
    }


def _tool_choice(req: ResponsesRequest) -> Any:
    choice = req.tool_choice
    return choice if isinstance(choice, str) else "auto" if choice is None else choice.model_dump()


async def create_response(request: Request) -> Response | dict[str, Any]:
    registry = models_of(request)
    req = parse_body(await request.body(), ResponsesRequest, lenient=registry.config.lenient_fields)
    state = await registry.generator(request, req.model)  # loaded, and kept so until the response ends
    ids, reading, params = await chat.prepare(state, req.chat_request())
    rid, created = new_id("resp"), now_s()
    # no capture: the evaluation loop replays completions and chat requests (evaluate/replay.py)
    gen = Generation(state, [ids], [[params]], rid)
    head = {"id": rid, "created_at": created, "model": req.model}
    builder = OutputBuilder(reading.parser())
    if req.stream:
        def body(output: list[dict[str, Any]], finish: str | None, tokens: int,
                 metrics: RequestMetrics | None) -> dict[str, Any]:
            return response_body(head, req, output, finish, len(ids), tokens, metrics)

        return EventStream(stream_events(gen, builder, body), gen)
    results = await gen.collect(request.receive)
    if results is None:
        return Response(status_code=499)
    (r,) = results
    builder.push(r.text)
    finish = builder.finish(r.finish_reason or "stop")
    return gen.reply(response_body(head, req, builder.output, finish, len(ids), len(r.token_ids), r.metrics))
