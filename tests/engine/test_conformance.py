"""The engine contract (scratchllm/engine/protocol.py), case by case, over every implementation:
the continuous engine (AsyncEngine), the static baseline (StaticEngine) and the fake engine. A
case that passes for one and fails for another is a drift the server would otherwise meet."""

import asyncio
import time

import pytest

from scratchllm.engine import AsyncEngine, EngineClient, EngineConfig, LLMEngine
from scratchllm.engine.fake import FakeEngine
from scratchllm.engine.protocol import FINISH_REASONS
from scratchllm.engine.static import StaticEngine
from scratchllm.errors import ConfigError
from scratchllm.sampling import SamplingParams

from .test_async_engine import LetterTokenizer  # token t is the letter chr(97 + t % 26)
from .tiny import tiny_llama


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=7)


@pytest.fixture(params=["continuous", "static", "fake"])
def engine(request, model):
    if request.param == "continuous":
        e = AsyncEngine(LLMEngine(model, EngineConfig(num_kv_blocks=256), tokenizer=LetterTokenizer()))
    elif request.param == "static":
        e = StaticEngine(model, LetterTokenizer(), batch_size=4)
    else:
        e = FakeEngine(step_ms=0.5, max_running=4)
    yield e
    e.shutdown(drain=False)


PROMPT = [5, 9, 14, 3, 7]


def greedy(n, **kw):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


def check_order(events, request_id=None):
    """The contract's event order: indexes 0..n-1, one finish_reason, on the last event, with metrics."""
    assert [e.index for e in events if e.token_id is not None] == list(range(sum(e.token_id is not None
                                                                                for e in events)))
    assert [e.finish_reason is not None for e in events] == [False] * (len(events) - 1) + [True]
    assert events[-1].finish_reason in FINISH_REASONS and events[-1].metrics is not None
    if request_id is not None:
        assert {e.request_id for e in events} == {request_id}


def wait_until(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def test_is_an_engine_client(engine):
    assert isinstance(engine, EngineClient)


def test_length_finish_and_event_order(engine):
    events = list(engine.submit(PROMPT, greedy(7), request_id="mine"))
    check_order(events, "mine")
    assert len(events) == 7 and events[-1].finish_reason == "length"
    m = events[-1].metrics
    assert m.prompt_tokens == len(PROMPT) and m.completion_tokens == 7
    assert m.arrival <= m.first_scheduled <= m.first_token <= m.finished
    assert min(m.queue_ms, m.prefill_ms, m.decode_ms) >= 0


def test_thread_and_event_loop_readers_see_the_same_events(engine):
    sync = [(e.token_id, e.text) for e in engine.submit(PROMPT, greedy(6))]

    async def read():
        return [(e.token_id, e.text) async for e in engine.submit(PROMPT, greedy(6))]

    assert asyncio.run(read()) == sync


def test_many_streams_on_one_loop(engine):
    async def one(i):
        return [e async for e in engine.submit(PROMPT + [i], greedy(3 + i % 4))]

    async def main():
        return await asyncio.gather(*(one(i) for i in range(12)))

    for i, events in enumerate(asyncio.run(main())):
        check_order(events)
        assert len(events) == 3 + i % 4


def test_text_deltas_join_and_stop_strings_cut(engine):
    full = "".join(e.text for e in engine.submit(PROMPT, greedy(16)))
    assert len(full) >= 10
    stop = full[6:8]
    cut = full.find(stop)
    events = list(engine.submit(PROMPT, greedy(16, stop=(stop,))))
    check_order(events)
    assert "".join(e.text for e in events) == full[:cut] and events[-1].finish_reason == "stop"


def test_abort_mid_stream_ends_the_stream_and_frees_its_blocks(engine):
    stream = engine.submit(PROMPT, greedy(500))
    events = []
    for e in stream:
        events.append(e)
        if len(events) == 2:
            stream.abort()
    check_order(events)
    assert events[-1].finish_reason == "abort" and len(events) < 500
    wait_until(lambda: engine.stats()["kv_blocks_used"] == 0)
    assert engine.stats()["finished"]["abort"] >= 1


def test_abort_by_id_before_it_runs(engine):
    streams = [engine.submit(PROMPT + [i], greedy(200)) for i in range(6)]
    for s in streams:
        engine.abort(s.request_id)
    for s in streams:
        events = list(s)
        check_order(events)
        assert events[-1].finish_reason == "abort"
    wait_until(lambda: engine.stats()["kv_blocks_used"] == 0)


def test_shutdown_without_drain_aborts_and_refuses_new_work(engine):
    streams = [engine.submit(PROMPT + [i], greedy(300)) for i in range(3)]
    engine.shutdown(drain=False)
    assert [list(s)[-1].finish_reason for s in streams] == ["abort"] * 3
    with pytest.raises(RuntimeError):
        engine.submit(PROMPT, greedy(2))


def test_bad_input_is_refused_at_submit(engine):
    with pytest.raises(ConfigError):
        engine.submit([], greedy(2))


def test_stats_name_the_same_counters(engine):
    list(engine.submit(PROMPT, greedy(3)))
    stats = engine.stats()
    for key in ("running", "waiting", "kv_blocks_used", "kv_blocks_peak", "kv_block_bytes", "preemptions",
                "finished", "policy"):
        assert key in stats, key
    assert stats["finished"]["length"] >= 1


def test_a_group_of_requests_on_one_prompt(engine):
    streams = engine.submit_group(PROMPT, [greedy(5), greedy(5), greedy(3)], ["g0", "g1", "g2"])
    events = {s.request_id: list(s) for s in streams}
    for rid, evs in events.items():
        check_order(evs, rid)
    assert [e.token_id for e in events["g0"]] == [e.token_id for e in events["g1"]]
    assert [e.token_id for e in events["g2"]] == [e.token_id for e in events["g0"]][:3]
    wait_until(lambda: engine.stats()["kv_blocks_used"] == 0)
