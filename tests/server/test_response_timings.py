"""The `timings` object of replies: the engine's split (queue + prefill + decode = the request's
end-to-end time), the server's own serialize / send time, and with `timings_per_token` each
token's times, through the official `openai` client (and httpx for the raw bytes) against a
live server over a fake engine whose step time is known (20 ms a token)."""

import json
import time

import httpx
import openai
import pytest

from scratchllm.server.app import ServerConfig, create_app
from scratchllm.server.backend import fake_backend

STEP_MS = 20.0
PER_TOKEN = {"timings_per_token": True}
CHAT = [{"role": "user", "content": "Tell me about café ☕"}]  # the fake's phrase has multi-byte characters


@pytest.fixture(scope="module")
def url(serve_module):
    model, embedder = fake_backend(step_ms=STEP_MS, max_running=8)
    with serve_module(create_app(model, embedder, ServerConfig(max_in_flight=16))) as base:
        yield base


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30)


def check_split(t, tokens):
    assert t["completion_tokens"] == tokens
    assert t["queue_ms"] + t["prefill_ms"] + t["decode_ms"] == pytest.approx(t["e2e_ms"], abs=0.01)
    # the fake sleeps STEP_MS before each token: the decode of tokens - 1 tokens cannot be shorter
    assert t["decode_ms"] >= (tokens - 1) * STEP_MS * 0.99
    assert t["ttft_ms"] == pytest.approx(t["queue_ms"] + t["prefill_ms"], abs=0.01)


def check_per_token(times, ttft_ms, e2e_ms):
    """times: (token_ms, token_latency_ms) per token, in order."""
    made = [m for m, _ in times]
    assert made == sorted(made)  # produced times never go back
    assert times[0][1] == pytest.approx(made[0], abs=0.002) == pytest.approx(ttft_ms, abs=0.002)
    for (prev, _), (now, latency) in zip(times, times[1:], strict=False):
        assert latency == pytest.approx(now - prev, abs=0.002)  # latency = the gap to the previous token
        assert latency >= STEP_MS * 0.99
    assert made[-1] <= e2e_ms + 0.002


def test_streamed_completion_has_times_on_every_chunk(client):
    n = 12
    chunks = list(client.completions.create(model="fake", prompt="naïve café", max_tokens=n, temperature=0,
                                            stream=True, extra_body=PER_TOKEN))
    assert len(chunks) == n  # one chunk per token, even for a token whose character is not complete yet
    timings = [c.model_extra["timings"] for c in chunks]
    assert [t["completion_tokens"] for t in timings] == list(range(1, n + 1))
    final = timings[-1]
    check_split(final, n)
    check_per_token([(t["token_ms"], t["token_latency_ms"]) for t in timings], final["ttft_ms"], final["e2e_ms"])


def test_streamed_chat_has_times_on_every_token_chunk(client):
    n = 10
    chunks = list(client.chat.completions.create(model="fake", messages=CHAT, max_tokens=n, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body=PER_TOKEN))
    role, *tokens, usage = chunks
    assert role.choices[0].delta.role == "assistant" and "timings" not in (role.model_extra or {})
    assert usage.choices == [] and "timings" not in (usage.model_extra or {})
    timings = [c.model_extra["timings"] for c in tokens]
    # the last token's text and the finish are two chunks (as OpenAI streams them): both carry its times
    assert [t["completion_tokens"] for t in timings] == [*range(1, n + 1), n]
    last_text, final = timings[-2:]
    assert (last_text["token_ms"], last_text["token_latency_ms"]) == (final["token_ms"], final["token_latency_ms"])
    check_split(final, n)
    check_per_token([(t["token_ms"], t["token_latency_ms"]) for t in timings[:-1]], final["ttft_ms"],
                    final["e2e_ms"])
    assert all(c.choices[0].finish_reason is None for c in tokens[:-1]) and tokens[-1].choices[0].finish_reason


def test_without_the_option_no_per_token_fields(client):
    chunks = list(client.chat.completions.create(model="fake", messages=CHAT, max_tokens=6, temperature=0,
                                                 stream=True))
    finals = [c for c in chunks if c.choices[0].finish_reason]
    assert all("timings" not in (c.model_extra or {}) for c in chunks if c not in finals)
    (final,) = finals
    t = final.model_extra["timings"]
    assert not {"token_ms", "token_latency_ms"} & set(t) and t["serialize_ms"] > 0 and t["send_ms"] > 0
    r = client.completions.create(model="fake", prompt="hi", max_tokens=4, temperature=0)
    assert not {"token_ms", "token_latency_ms"} & set(r.model_extra["timings"])


def test_non_streamed_reply_lists_per_token_times(client):
    n = 8
    r = client.chat.completions.create(model="fake", messages=CHAT, max_tokens=n, temperature=0, extra_body=PER_TOKEN)
    t = r.model_extra["timings"]
    check_split(t, n)
    assert len(t["token_ms"]) == len(t["token_latency_ms"]) == n
    check_per_token(list(zip(t["token_ms"], t["token_latency_ms"], strict=True)), t["ttft_ms"], t["e2e_ms"])
    assert t["serialize_ms"] > 0 and t["send_ms"] is None  # the body is sent after it is written


def test_each_choice_has_its_own_token_times(client):
    chunks = list(client.completions.create(model="fake", prompt="abc", max_tokens=5, n=2, temperature=0.7, seed=3,
                                            stream=True, extra_body=PER_TOKEN))
    for k in (0, 1):
        mine = [c.model_extra["timings"] for c in chunks if c.choices[0].index == k]
        assert [t["completion_tokens"] for t in mine] == [1, 2, 3, 4, 5]
        check_per_token([(t["token_ms"], t["token_latency_ms"]) for t in mine], mine[-1]["ttft_ms"],
                        mine[-1]["e2e_ms"])


def test_serialize_ms_covers_the_chunks_before_the_last(url):
    """serialize_ms against json.dumps of the same payloads, timed here: the server's encoding
    of a chunk is that dumps and a little more, so its sum cannot be much below ours."""
    body = {"model": "fake", "prompt": "hello", "max_tokens": 16, "temperature": 0, "stream": True}
    started = time.monotonic()
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    wall_ms = (time.monotonic() - started) * 1e3
    assert lines[-1] == "[DONE]"
    payloads = [json.loads(x) for x in lines[:-1]]
    t = payloads[-1]["timings"]
    before_last = payloads[:-1]
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for p in before_last:
            json.dumps(p, separators=(",", ":"), ensure_ascii=False).encode()
        best = min(best, time.perf_counter() - start)
    assert best * 1e3 * 0.2 <= t["serialize_ms"] <= len(before_last) * 5.0
    assert 0 < t["send_ms"] < wall_ms and t["serialize_ms"] + t["send_ms"] < wall_ms


@pytest.mark.parametrize("value", ["yes", 1, [True], {"on": True}])
def test_a_bad_value_is_a_400_naming_the_field(url, value):
    for path, extra in (("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", {"messages": CHAT})):
        r = httpx.post(url + path, json={"model": "fake", "max_tokens": 2, **extra, "timings_per_token": value})
        assert r.status_code == 400 and r.json()["error"]["param"] == "timings_per_token", r.text


def test_null_means_the_default(url):
    r = httpx.post(url + "/v1/completions", json={"model": "fake", "prompt": "hi", "max_tokens": 2,
                                                   "timings_per_token": None})
    assert r.status_code == 200 and "token_ms" not in r.json()["timings"]
    assert r.headers["content-type"] == "application/json"


def test_a_body_is_encoded_whole_with_its_serialization_last():
    from scratchllm.server.sse import ChunkTrace

    body = {"id": "x", "choices": [{"text": "café ☕"}], "timings": {"e2e_ms": 1.5}}
    data = ChunkTrace(None, "x").encode_body(body)
    out = json.loads(data)
    assert list(out) == list(body) and out["choices"] == body["choices"] and "café ☕".encode() in data
    assert out["timings"] == {"e2e_ms": 1.5, "serialize_ms": out["timings"]["serialize_ms"], "send_ms": None}
    assert out["timings"]["serialize_ms"] >= 0
    assert json.loads(ChunkTrace(None, "y").encode_body({"id": "y", "timings": None})) == {"id": "y", "timings": None}
