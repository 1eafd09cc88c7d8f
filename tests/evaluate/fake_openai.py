"""An OpenAI-compatible server as an httpx transport: answers from a function of the prompt,
records every request, can fail the first attempts and tracks requests in flight per host."""

import asyncio
import json

import httpx


def _tokens(text):
    return [w if i == 0 else " " + w for i, w in enumerate(text.split(" "))]


class FakeOpenAI(httpx.AsyncBaseTransport):
    def __init__(self, answers: dict, fail_first: dict | None = None, delay_s: float = 0.0):
        self.answers = answers  # host -> fn(prompt text) -> answer text
        self.fail_first = dict(fail_first or {})  # host -> how many 503s before answering
        self.delay_s = delay_s
        self.seen: list[tuple[str, str, dict, dict]] = []  # (host, path, body, headers)
        self.in_flight: dict[str, int] = {}
        self.max_in_flight: dict[str, int] = {}

    async def handle_async_request(self, request):
        host = request.url.host
        body = json.loads(request.content)
        self.seen.append((host, request.url.path, body, dict(request.headers)))
        self.in_flight[host] = self.in_flight.get(host, 0) + 1
        self.max_in_flight[host] = max(self.max_in_flight.get(host, 0), self.in_flight[host])
        try:
            await asyncio.sleep(self.delay_s)
            if self.fail_first.get(host, 0) > 0:
                self.fail_first[host] -= 1
                return httpx.Response(503, json={"error": {"message": "busy"}}, headers={"Retry-After": "0"})
            chat = request.url.path.endswith("/chat/completions")
            prompt = body["messages"][-1]["content"] if chat else body["prompt"]
            text = self.answers[host](prompt)
            toks = _tokens(text)
            if chat:
                lp = {"content": [{"token": t, "logprob": -0.5, "top_logprobs": [{"token": t, "logprob": -0.5}]}
                                  for t in toks]}
                choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": lp,
                          "finish_reason": "length"}
            else:
                lp = {"tokens": toks, "token_logprobs": [-0.5] * len(toks), "top_logprobs": [{t: -0.5} for t in toks]}
                choice = {"index": 0, "text": text, "logprobs": lp, "finish_reason": "length"}
            return httpx.Response(200, json={"choices": [choice], "timings": {"e2e_ms": 1.0}})
        finally:
            self.in_flight[host] -= 1
