"""Every token's time (TokenEvent.elapsed), over every engine: set on each event with a token,
in the order the tokens were made, and on the same clock as the request's metrics, so the first
token's elapsed is its time to first token and no token comes after the request finished."""

import time

import pytest

from scratchllm.engine import AsyncEngine, EngineConfig, LLMEngine
from scratchllm.engine.output import OutputProcessor
from scratchllm.sampling import SamplingParams

from .test_async_engine import LetterTokenizer
from .test_conformance import PROMPT, engine, greedy, loop, model  # noqa: F401 - fixtures over all four engines
from .tiny import tiny_llama


def test_each_token_has_its_time_since_arrival(engine):  # noqa: F811 - the imported fixture
    events = list(engine.submit(PROMPT, greedy(9)))
    tokens = [e for e in events if e.token_id is not None]
    assert len(tokens) == 9 and all(e.elapsed is not None for e in tokens)
    elapsed = [e.elapsed for e in tokens]
    assert elapsed == sorted(elapsed) and elapsed[0] > 0
    m = events[-1].metrics
    assert elapsed[0] * 1e3 == pytest.approx(m.ttft_ms, abs=1e-6)  # the first token's time is its TTFT
    assert elapsed[-1] * 1e3 <= m.e2e_ms + 1e-6
    assert m.e2e_ms == pytest.approx(m.queue_ms + m.prefill_ms + m.decode_ms, abs=1e-6)


def test_results_keep_the_times_and_an_abort_has_none():
    llm = LLMEngine(tiny_llama(seed=3), EngineConfig(num_kv_blocks=64), tokenizer=LetterTokenizer())
    out = llm.generate([[4, 8, 15, 16], [23, 42]], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    for r in out:
        assert len(r.token_elapsed) == len(r.token_ids) == 6 and r.token_elapsed == sorted(r.token_elapsed)
        assert r.token_elapsed[-1] == pytest.approx(r.metrics.e2e_ms / 1e3, abs=1e-9)  # the step's one clock
    llm.add_request("gone", [1, 2, 3], SamplingParams(max_tokens=4))
    assert llm.abort("gone").elapsed is None


def test_the_output_path_reads_no_clock():
    """`now` comes from the engine's step: the output path subtracts, nothing more."""
    p = OutputProcessor("r", SamplingParams(max_tokens=2), None, (), arrival=100.0)
    assert p.process(5, now=100.25).elapsed == 0.25 and p.process(6, now=101.0).elapsed == 1.0


def test_arrival_is_the_submission_not_the_next_step():
    """A request submitted while a step runs has queued from its submit on: the engine thread
    takes it in only after the step, but its arrival (and so queue_ms and every elapsed) counts
    from the submit."""
    running = AsyncEngine(LLMEngine(tiny_llama(seed=3, layers=4, hidden=64), EngineConfig(num_kv_blocks=256)))
    try:
        busy = [running.submit(list(range(1 + i, 90 + i)), SamplingParams(max_tokens=200, ignore_eos=True))
                for i in range(8)]
        next(iter(busy[0]))  # the engine is stepping now: 8 sequences a step
        before = time.monotonic()
        stream = running.submit([5, 6, 7], greedy(3))
        after = time.monotonic()
        events = list(stream)
        m = events[-1].metrics
        assert before <= m.arrival <= after
        assert events[0].elapsed * 1e3 == pytest.approx(m.queue_ms + m.prefill_ms, abs=1e-6)
    finally:
        running.shutdown(drain=False)
