"""AsyncEngine: concurrent submitters get exactly the tokens each request gets alone; text deltas
join to the final text, stop strings cut it; abort and shutdown return every block."""

import threading

import pytest

from scratchllm.engine import AsyncEngine, EngineConfig, LLMEngine
from scratchllm.errors import ConfigError
from scratchllm.sampling import SamplingParams

from .tiny import greedy_alone, tiny_llama


class LetterTokenizer:
    """Token id t is the letter chr(97 + t % 26); enough to test deltas and stop strings."""

    eos_token_id, end_token_ids = None, frozenset()

    def detokenizer(self, skip_special_tokens=False):
        class D:
            def push(self, t):
                return chr(97 + t % 26)

        return D()


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=5)


def collect(stream):
    events = list(stream)
    return [e.token_id for e in events], "".join(e.text for e in events), events[-1]


def test_concurrent_submitters_get_their_own_tokens(model):
    engine = AsyncEngine(LLMEngine(model, EngineConfig(num_kv_blocks=128)))
    prompts = [[i, i + 1, (3 * i) % 97, 4] * (1 + i % 3) for i in range(12)]
    results = {}

    def client(i):
        stream = engine.submit(prompts[i], SamplingParams(max_tokens=6 + i, temperature=0.0))
        results[i] = collect(stream)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    engine.shutdown()
    for i in range(12):
        tokens, _, last = results[i]
        assert tokens == greedy_alone(model, prompts[i], 6 + i)
        assert last.finish_reason == "length" and last.metrics.completion_tokens == 6 + i
        assert [e for e in [last.metrics.queue_ms, last.metrics.prefill_ms, last.metrics.decode_ms] if e < 0] == []
    assert engine.stats().kv_blocks_used == 0


def test_text_deltas_and_stop_strings(model):
    engine = LLMEngine(model, EngineConfig(num_kv_blocks=64), tokenizer=LetterTokenizer())
    prompt = [1, 2, 3]
    alone = greedy_alone(model, prompt, 20)
    full = "".join(chr(97 + t % 26) for t in alone)
    stop = full[8:10]
    cut = full.find(stop)
    a = AsyncEngine(engine)
    tokens, text, last = collect(a.submit(prompt, SamplingParams(max_tokens=20, temperature=0.0, stop=[stop])))
    assert text == full[:cut] and last.finish_reason == "stop"
    tokens, text, last = collect(a.submit(prompt, SamplingParams(max_tokens=20, temperature=0.0)))
    assert text == full and tokens == alone
    a.shutdown()


def test_abort_mid_stream_returns_all_blocks(model):
    a = AsyncEngine(LLMEngine(model, EngineConfig(num_kv_blocks=64)))
    stream = a.submit(list(range(30)), SamplingParams(max_tokens=400, temperature=0.0))
    events = []
    for e in stream:
        events.append(e)
        if len(events) == 3:
            stream.abort()
    assert events[-1].finish_reason == "abort" and len(events) < 400
    a.shutdown()
    assert a.stats().kv_blocks_used == 0 and a.stats().finished["abort"] == 1


def test_shutdown_without_drain_aborts_and_with_drain_finishes(model):
    a = AsyncEngine(LLMEngine(model, EngineConfig(num_kv_blocks=64)))
    streams = [a.submit([1, 2, 3, i], SamplingParams(max_tokens=300, temperature=0.0)) for i in range(4)]
    a.shutdown(drain=False)
    assert {list(s)[-1].finish_reason for s in streams} == {"abort"}
    with pytest.raises(RuntimeError):
        a.submit([1], SamplingParams())
    b = AsyncEngine(LLMEngine(model, EngineConfig(num_kv_blocks=64)))
    streams = [b.submit([1, 2, 3, i], SamplingParams(max_tokens=5, temperature=0.0)) for i in range(4)]
    b.shutdown(drain=True)
    assert [list(s)[-1].finish_reason for s in streams] == ["length"] * 4


def test_submit_refuses_bad_input_at_once(model):
    a = AsyncEngine(LLMEngine(model, EngineConfig(num_kv_blocks=8, block_size=4)))
    with pytest.raises(ConfigError):
        a.submit([], SamplingParams())
    with pytest.raises(ConfigError):
        a.submit(list(range(40)), SamplingParams())
    a.shutdown()


def test_idle_loop_waits_a_tick_instead_of_spinning(model):
    """LOW requests enter 2 per 10 ms tick; between ticks the engine thread sleeps."""
    import time

    engine = LLMEngine(model, EngineConfig(num_kv_blocks=128, tick_s=0.05))
    empty = []
    step = engine.step

    def counting_step():
        out = step()
        if engine.last_step_tokens == 0:
            empty.append(time.monotonic())
        return out

    engine.step = counting_step
    a = AsyncEngine(engine)
    start = time.monotonic()
    streams = [a.submit([1, 2, i], SamplingParams(max_tokens=256, temperature=0.0)) for i in range(6)]
    admitted_first = []
    for s in streams:
        events = list(s)
        assert events[-1].finish_reason == "length"
        admitted_first.append(events[-1].metrics.first_scheduled - start)
    a.shutdown()
    elapsed = time.monotonic() - start
    assert len(empty) <= elapsed / 0.05 + 5  # at most about one idle step per tick
    assert sorted(admitted_first)[2] >= 0.04  # the third LOW request waited for the second tick
