"""n > 1 sampling on forked KV blocks: the choices of one prompt share its blocks (computed once,
copied on write), use fewer blocks than as many separate requests, and each choice's tokens
equal a request of its own with the same params, greedy or seeded."""

import dataclasses

import pytest

from scratchllm.engine import AsyncEngine, EngineConfig, LLMEngine
from scratchllm.sampling import SamplingParams

from .tiny import tiny_llama

PROMPT = [(7 * i + 3) % 90 + 1 for i in range(53)]  # 3 full blocks and a partial one


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=21)


def engine(model, **kw):
    return LLMEngine(model, EngineConfig(num_kv_blocks=256, **kw))


def run_all(e):
    out = {}
    while e.has_work():
        for ev in e.step():
            out.setdefault(ev.request_id, []).append(ev)
    return out


def choices(n, **kw):
    base = SamplingParams(max_tokens=20, temperature=0.9, ignore_eos=True, seed=100, **kw)
    return [dataclasses.replace(base, seed=100 + i) for i in range(n)]


def test_each_choice_equals_its_own_request(model):
    group = engine(model)
    reqs = group.add_group(["a", "b", "c", "d"], PROMPT, choices(4))
    got = run_all(group)
    for req, p in zip(reqs, choices(4), strict=True):
        alone = engine(model)
        alone.add_request("x", PROMPT, p)
        want = [ev.token_id for ev in run_all(alone)["x"]]
        assert [ev.token_id for ev in got[req.request_id]] == want
    assert len({tuple(ev.token_id for ev in v) for v in got.values()}) > 1  # the seeds differ
    assert group.block_manager.num_used == 0
    group.block_manager.check([])


def test_the_prompt_is_stored_once(model):
    group, separate = engine(model), engine(model)
    group.add_group([None] * 4, PROMPT, choices(4))
    for i, p in enumerate(choices(4)):
        separate.add_request(f"s{i}", PROMPT, p)
    run_all(group)
    run_all(separate)
    g, s = group.block_manager.stats.peak_used, separate.block_manager.stats.peak_used
    # separately: 4 x (4 prompt blocks + output); forked: the 3 full prompt blocks once
    assert g <= s - 3 * 3, (g, s)
    assert group.stats().steps <= separate.stats().steps


def test_greedy_choices_agree_and_one_token_choices_finish_without_blocks(model):
    group = engine(model)
    greedy = SamplingParams(max_tokens=6, temperature=0.0)
    group.add_group(["g1", "g2", "g3"], PROMPT, [greedy, greedy, dataclasses.replace(greedy, max_tokens=1)])
    got = run_all(group)
    assert [e.token_id for e in got["g1"]] == [e.token_id for e in got["g2"]]
    assert len(got["g3"]) == 1 and got["g3"][0].finish_reason == "length"
    assert group.block_manager.num_used == 0


def test_abort_before_and_after_the_fork(model):
    e = engine(model)
    e.add_group(["p", "q", "r"], PROMPT, choices(3))
    e.abort("q")  # still waiting to fork
    e.abort("p")  # the parent, before its prefill: r becomes a request of its own
    got = run_all(e)
    assert set(got) == {"r"} and got["r"][-1].finish_reason == "length" and len(got["r"]) == 20
    e.add_group(["u", "v"], PROMPT, choices(2))
    e.step()  # the parent's prefill: v forks
    assert e.abort("v").finish_reason == "abort"
    got = run_all(e)
    assert got["u"][-1].finish_reason == "length"
    assert e.block_manager.num_used == 0
    e.block_manager.check([])


def test_async_engine_streams_a_group(model):
    a = AsyncEngine(engine(model))
    streams = a.submit_group(PROMPT, choices(3), ["x", "y", "z"])
    texts = {s.request_id: [ev.token_id for ev in s] for s in streams}
    a.shutdown()
    assert set(texts) == {"x", "y", "z"} and all(len(v) == 20 for v in texts.values())
    assert a.stats().kv_blocks_used == 0
