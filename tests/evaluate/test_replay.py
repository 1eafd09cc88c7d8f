"""Replay against OpenAI-compatible fakes: the body each server gets, three outputs per request in
the run file, retries, the API key, bounded concurrency, and the second pass on the primary."""

import pytest

from scratchllm.errors import ConfigError
from scratchllm.evaluate.replay import ReplayOptions, replay, replay_body
from scratchllm.evaluate.sources import CapturedRequest, Traffic

from .fake_openai import FakeOpenAI

P, S, C = "http://primary:1", "http://secondary:2", "http://candidate:3"


def traffic(n=6):
    reqs = [CapturedRequest("/v1/completions", {"model": "m", "prompt": f"p{i}", "max_tokens": 8, "stream": True,
                                                "temperature": 0.9}, f"cap:{i + 1}") for i in range(n)]
    reqs.append(CapturedRequest("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                         "seed": 7, "temperature": 0.7}, f"cap:{n + 1}"))
    return Traffic(reqs)


def echo(prompt):
    return f"answer to {prompt}"


def test_replay_body_is_greedy_or_seeded_with_logprobs():
    opts = ReplayOptions(P, C, top_logprobs=3, max_tokens=4)
    t = traffic(1).requests
    assert replay_body(t[0], opts) == {"model": "m", "prompt": "p0", "max_tokens": 4, "temperature": 0.0,
                                       "logprobs": 3}
    chat = replay_body(t[1], opts)
    assert (chat["seed"], chat["temperature"], chat["logprobs"], chat["top_logprobs"]) == (7, 0.7, True, 3)
    assert replay_body(t[1], ReplayOptions(P, C, sampling="greedy"))["temperature"] == 0.0


def test_replay_records_three_outputs_with_retries_and_bounded_concurrency(tmp_path):
    fake = FakeOpenAI({"primary": echo, "secondary": echo, "candidate": lambda p: f"reply to {p}"},
                      fail_first={"candidate": 2}, delay_s=0.01)
    opts = ReplayOptions(P, C, secondary=S, api_key="sk-test", concurrency=2, backoff_s=0.0, progress=False)
    store = replay(traffic(), tmp_path / "run.sqlite", opts, capture="cap", transport=fake)
    assert {h for h, *_ in fake.seen} == {"primary", "secondary", "candidate"}
    assert all(headers["authorization"] == "Bearer sk-test" for *_, headers in fake.seen)
    assert max(fake.max_in_flight.values()) <= 2
    reqs = store.requests()
    assert len(reqs) == 7
    outs = store.outputs(reqs[0]["id"])
    assert outs["primary"].text == "answer to p0" and outs["candidate"].text == "reply to p0"
    assert outs["primary"].tokens == ["answer", " to", " p0"] and outs["primary"].top_logprobs[0] == [("answer", -0.5)]
    assert outs["primary"].latency_ms > 0
    chat = store.outputs(reqs[-1]["id"])["candidate"]
    assert chat.text == "reply to hi" and chat.tokens == ["reply", " to", " hi"]
    attempts = sorted(store.outputs(r["id"])["candidate"].attempts for r in reqs)
    assert sum(attempts) == len(reqs) + 2  # the two 503s were retried
    assert store.run()["secondary_url"] == S


def test_without_secondary_the_primary_answers_twice(tmp_path):
    fake = FakeOpenAI({"primary": echo, "candidate": echo})
    store = replay(traffic(2), tmp_path / "run.sqlite", ReplayOptions(P, C, progress=False), transport=fake)
    hosts = [h for h, *_ in fake.seen]
    assert hosts.count("primary") == 6 and hosts.count("candidate") == 3
    assert store.run()["secondary_url"] == P


def test_errors_are_recorded_not_retried(tmp_path):
    fake = FakeOpenAI({"primary": echo, "candidate": echo, "secondary": lambda p: p[1000]})  # IndexError -> 500

    class Refusing(FakeOpenAI):
        async def handle_async_request(self, request):
            if request.url.host == "secondary":
                import httpx
                return httpx.Response(400, json={"error": {"message": "bad"}})
            return await super().handle_async_request(request)

    fake = Refusing(fake.answers)
    store = replay(traffic(1), tmp_path / "r.sqlite", ReplayOptions(P, C, secondary=S, progress=False),
                   transport=fake)
    out = store.outputs(store.requests()[0]["id"])["secondary"]
    assert out.status == 400 and out.attempts == 1 and "HTTP 400" in out.error


def test_bad_options_and_existing_run_file(tmp_path):
    with pytest.raises(ConfigError, match="URL"):
        ReplayOptions("primary:1", C)
    (tmp_path / "run.sqlite").write_text("")
    with pytest.raises(ConfigError, match="already exists"):
        replay(traffic(1), tmp_path / "run.sqlite", ReplayOptions(P, C, progress=False), transport=FakeOpenAI({}))
