"""A reply as Responses output items, and the stream events that build them.

`OutputBuilder` takes a chat reply's parts as they come (tool_calls.ReplyParser: thinking,
content, tool-call deltas) and keeps the `output` list: a `reasoning` item, `message` items
(one `output_text` part each) and `function_call` items, in the order the model wrote them.
Every change is also an event of the Responses stream, in its order: output_item.added,
content_part.added, output_text.delta / reasoning_text.delta / function_call_arguments.delta,
their .done events, output_item.done; the stream (stream_events) wraps them in
response.created, response.in_progress and response.completed (or response.incomplete when
max_output_tokens cut the reply), each with its sequence_number. The unstreamed reply runs the
same builder over the whole text, so both carry the same items.
"""

import uuid
from collections.abc import AsyncGenerator, Callable
from typing import Any

from scratchllm.engine.protocol import RequestMetrics
from scratchllm.server.generation import Generation
from scratchllm.server.tool_calls import ReplyParser

Event = dict[str, Any]


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


class OutputBuilder:
    """See the module doc. `events` holds the events not yet taken (take())."""

    def __init__(self, parser: ReplyParser) -> None:
        self.parser = parser
        self.output: list[dict[str, Any]] = []
        self.events: list[Event] = []
        self.open: int | None = None  # the output index of the item being written
        self.calls: dict[int, int] = {}  # tool-call delta index -> output index

    def take(self) -> list[Event]:
        events, self.events = self.events, []
        return events

    def push(self, text: str) -> None:
        self._parts(self.parser.push(text))

    def finish(self, finish_reason: str) -> str:
        """Close the reply; returns its finish_reason ("tool_calls" after completed calls)."""
        parts, finish = self.parser.finish(finish_reason)
        self._parts(parts)
        self._close("incomplete" if finish in ("length", "abort") else "completed")
        return finish

    # --- items -----------------------------------------------------------------------------
    def _parts(self, parts: dict[str, Any]) -> None:
        if parts.get("reasoning_content"):
            item = self._item("reasoning", {"type": "reasoning", "id": _id("rs"), "summary": [],
                                            "content": [{"type": "reasoning_text", "text": ""}]})
            self._delta(item, "response.reasoning_text.delta", parts["reasoning_content"], content_index=0)
        if parts.get("content"):
            item = self._item("message", {"type": "message", "id": _id("msg"), "role": "assistant", "content": []})
            if not item["content"]:
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                item["content"].append(part)
                self._event("response.content_part.added", item, content_index=0, part=dict(part))
            self._delta(item, "response.output_text.delta", parts["content"], content_index=0, logprobs=[])
        for d in parts.get("tool_calls", []):
            if "id" in d:
                self._close("completed")
                item = self._item("function_call", {"type": "function_call", "id": _id("fc"), "call_id": d["id"],
                                                    "name": d["function"]["name"], "arguments": ""}, new=True)
                self.calls[d["index"]] = self.output.index(item)
            delta = d.get("function", {}).get("arguments", "")
            if delta:
                item = self.output[self.calls[d["index"]]]
                item["arguments"] += delta
                self._event("response.function_call_arguments.delta", item, delta=delta)

    def _item(self, kind: str, fresh: dict[str, Any], new: bool = False) -> dict[str, Any]:
        """The open item if it is of this kind (and a new one is not asked for), else `fresh`, opened."""
        if self.open is not None and self.output[self.open]["type"] == kind and not new:
            return self.output[self.open]
        self._close("completed")
        fresh["status"] = "in_progress"
        self.output.append(fresh)
        self.open = len(self.output) - 1
        self._event("response.output_item.added", fresh, payload=_copy(fresh))
        return fresh

    def _delta(self, item: dict[str, Any], kind: str, text: str, **fields: Any) -> None:
        part = item["content"][0]
        part["text"] += text
        self._event(kind, item, delta=text, **fields)

    def _close(self, status: str) -> None:
        if self.open is None:
            return
        item, self.open = self.output[self.open], None
        item["status"] = status
        if item["type"] == "reasoning":
            self._event("response.reasoning_text.done", item, content_index=0, text=item["content"][0]["text"])
        elif item["type"] == "message":
            part = item["content"][0]
            self._event("response.output_text.done", item, content_index=0, text=part["text"], logprobs=[])
            self._event("response.content_part.done", item, content_index=0, part=dict(part))
        else:
            self._event("response.function_call_arguments.done", item, arguments=item["arguments"], name=item["name"])
        self._event("response.output_item.done", item, payload=_copy(item))

    def _event(self, kind: str, item: dict[str, Any], payload: dict[str, Any] | None = None, **fields: Any) -> None:
        """An event about `item`; `payload`: the item as the event carries it (output_item events)."""
        at = self.output.index(item)
        where = {"output_index": at, "item": payload} if payload is not None else \
            {"item_id": item["id"], "output_index": at}
        self.events.append({"type": kind, **where, **fields})


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    return {**item, **({"content": [dict(p) for p in item["content"]]} if "content" in item else {})}


# The Response object for (output items, finish_reason or None while in progress, output tokens, metrics)
ResponseBody = Callable[[list[dict[str, Any]], str | None, int, RequestMetrics | None], dict[str, Any]]


async def stream_events(gen: Generation, builder: OutputBuilder, body: ResponseBody) -> AsyncGenerator[bytes, None]:
    """The Responses event stream of one generation (no [DONE]: the last event ends it)."""
    seq = 0

    def encode(event: Event) -> bytes:
        nonlocal seq
        event = {**event, "sequence_number": seq}
        seq += 1
        return f"event: {event['type']}\n".encode() + gen.chunks.encode(event)

    started = body([], None, 0, None)
    yield encode({"type": "response.created", "response": started})
    yield encode({"type": "response.in_progress", "response": started})
    tokens = 0
    async for _, event in gen.merged():
        tokens += event.token_id is not None
        if event.text:
            builder.push(event.text)
        if event.finish_reason is not None:
            finish = builder.finish(event.finish_reason)
            for e in builder.take():
                yield encode(e)
            done = body(builder.output, finish, tokens, event.metrics)
            kind = "response.completed" if done["status"] == "completed" else "response.incomplete"
            yield encode({"type": kind, "response": done})
            return
        for e in builder.take():
            yield encode(e)
