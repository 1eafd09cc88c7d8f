"""The scheduler pinned rule by rule: the 10 ms tick, 80% gate, at most 2 LOW per tick, FIFO in
HIGH; plus aging (bounded starvation), the priority hook, chunked prefill and preemption."""

import pytest

from scratchllm.engine.block_manager import BlockManager
from scratchllm.engine.config import EngineConfig
from scratchllm.engine.request import Priority, Request, RequestStatus
from scratchllm.engine.scheduler import ScheduledBatch, Scheduler
from scratchllm.sampling import SamplingParams


def make(cfg=None, num_blocks=64, **kw):
    cfg = cfg or EngineConfig(**kw)
    return Scheduler(cfg, BlockManager(num_blocks, cfg.block_size))


def req(rid, prompt_len=4, max_tokens=8, arrival=0.0, priority=None):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    if priority is None:
        priority = Priority.HIGH if max_tokens < 256 else Priority.LOW
    return Request(rid, list(range(1, prompt_len + 1)), params, priority, arrival=arrival)


def run_step(s, batch):
    """What the engine does around the forward: one token for each request whose step reaches
    its last token; requests at max_tokens finish. The scheduler's own update() does the rest."""
    finished = []
    for r, n in batch.items:
        if r.num_computed_tokens + n == r.num_tokens:
            r.append_token(7, 0.0)
            if r.num_output_tokens >= r.params.max_tokens:
                r.finish("length", 0.0)
                finished.append(r)
    s.update(batch, finished)


def finish(s, r):
    """A running request ends between steps (as an abort would)."""
    r.finish("abort", 0.0)
    assert s.abort(r)


def admitted_ids(batch):
    return [r.request_id for r in batch.admitted]


def test_high_queue_is_fifo_and_admitted_at_once():
    s = make()
    for i in range(5):
        s.add(req(f"h{i}", arrival=0.001 * i))
    batch = s.schedule(now=0.0)
    assert admitted_ids(batch) == ["h0", "h1", "h2", "h3", "h4"]


def test_high_head_admitted_without_waiting_for_the_tick():
    s = make()
    for i in range(3):
        s.add(req(f"l{i}", max_tokens=300))
    assert len(s.schedule(now=0.0).admitted) == 2  # a tick began at 0
    s.add(req("h", arrival=0.001))
    assert admitted_ids(s.schedule(now=0.001)) == ["h"]  # same tick, still admitted at once


def test_at_most_two_low_per_tick():
    s = make()
    for i in range(5):
        s.add(req(f"l{i}", max_tokens=300))
    per_step = []
    for now in (0.0, 0.004, 0.0099, 0.010, 0.015, 0.020, 0.030):
        batch = s.schedule(now=now)
        per_step.append(admitted_ids(batch))
        run_step(s, batch)
    assert per_step == [["l0", "l1"], [], [], ["l2", "l3"], [], ["l4"], []]


def test_the_tick_and_the_low_limit_are_options():
    s = make(tick_s=0.05, max_low_per_tick=3)
    for i in range(5):
        s.add(req(f"l{i}", max_tokens=300))
    assert len(s.schedule(now=0.0).admitted) == 3
    assert len(s.schedule(now=0.04).admitted) == 0
    assert len(s.schedule(now=0.05).admitted) == 2


def test_the_80_percent_gate_on_kv_occupancy():
    s = make(num_blocks=10)
    big = req("big", prompt_len=8 * 16 - 2, max_tokens=300)  # 8 of 10 blocks: occupancy 80%
    s.add(big)
    run_step(s, s.schedule(now=0.0))
    assert s.bm.occupancy >= 0.8
    s.add(req("h", arrival=0.001))
    assert s.schedule(now=0.02).admitted == []  # gate closed
    finish(s, big)
    assert admitted_ids(s.schedule(now=0.021)) == ["h"]  # below the gate: at once


def test_the_80_percent_gate_on_batch_fill():
    s = make(max_num_batched_tokens=100)
    s.add(req("long", prompt_len=500))  # its chunk fills the budget
    s.add(req("h", arrival=0.001))
    batch = s.schedule(now=0.0)
    assert admitted_ids(batch) == ["long"]
    s.bm.check([r for r, _ in batch.items])


def test_gate_threshold_is_an_option():
    s = make(num_blocks=10, utilization_gate=0.95)
    big = req("big", prompt_len=8 * 16 - 2, max_tokens=300)
    s.add(big)
    run_step(s, s.schedule(now=0.0))
    s.add(req("h", prompt_len=4, arrival=0.001))
    assert admitted_ids(s.schedule(now=0.02)) == ["h"]  # 80% < 95%


def test_low_waits_while_high_is_blocked():
    s = make(num_blocks=10)
    big = req("big", prompt_len=8 * 16 - 2, max_tokens=300)
    s.add(big)
    run_step(s, s.schedule(now=0.0))
    s.add(req("h", arrival=0.001))
    s.add(req("l", max_tokens=300, arrival=0.0))
    assert s.schedule(now=0.02).admitted == []


def _starvation_run(aging_s, steps=400):
    """Every 10 ms step a new HIGH request arrives; only 2 sequences fit at once and each runs
    4 steps, so HIGH is never empty. Returns the time the LOW request was admitted (or None)."""
    s = make(max_num_seqs=2, aging_s=aging_s, max_priority_adjust_s=0.0)
    for i in range(3):
        s.add(req(f"first{i}", max_tokens=4, arrival=0.0))
    low = req("low", max_tokens=300, arrival=0.0)
    s.add(low)
    for step in range(steps):
        now = step * 0.010
        s.add(req(f"h{step}", max_tokens=4, arrival=now))
        batch = s.schedule(now=now)
        if low in batch.admitted:
            return now
        run_step(s, batch)
    return None


def test_without_aging_low_starves():
    assert _starvation_run(aging_s=1e9) is None


def test_aging_bounds_the_wait():
    admitted_at = _starvation_run(aging_s=0.5)
    # promoted at 0.5 s to HIGH's tail; ahead of it at most the 3 + 51 HIGH requests that
    # arrived by then, 2 admitted every 4 steps of 10 ms
    bound = 0.5 + (3 + 0.5 / 0.010 + 1) / 2 * 4 * 0.010
    assert admitted_at is not None and 0.5 <= admitted_at <= bound


def test_priority_hook_moves_a_request_within_low():
    s = make()
    s.priority_hook = lambda r: 1.0 if r.request_id == "favoured" else 0.0
    s.add(req("a", max_tokens=300, arrival=0.0))
    s.add(req("b", max_tokens=300, arrival=0.1))
    s.add(req("favoured", max_tokens=300, arrival=0.2))
    assert admitted_ids(s.schedule(now=0.3)) == ["favoured", "a"]


def test_priority_hook_is_clamped():
    s = make(max_priority_adjust_s=0.5, aging_s=10.0)
    s.priority_hook = lambda r: 100.0
    r = req("x", max_tokens=300)
    s.add(r)
    assert r.priority_adjust_s == 0.5


def test_adjust_priority_reorders_a_queued_request():
    s = make()
    a, b = req("a", max_tokens=300, arrival=0.0), req("b", max_tokens=300, arrival=0.5)
    s.add(a)
    s.add(b)
    s.adjust_priority(b, 1.0)
    assert admitted_ids(s.schedule(now=0.6)) == ["b", "a"]


def test_chunked_prefill_spends_the_budget_and_decodes_go_first():
    s = make(max_num_batched_tokens=32)
    d = req("d", prompt_len=4, max_tokens=100)
    s.add(d)
    run_step(s, s.schedule(now=0.0))  # d prefilled, now decoding
    p = req("p", prompt_len=100, max_tokens=4, arrival=0.01)
    s.add(p)
    chunks = []
    for step in range(1, 6):
        batch = s.schedule(now=0.01 * step)
        assert batch.items[0] == (d, 1)  # the decode first
        assert batch.num_tokens <= 32
        chunks.append(dict((r.request_id, n) for r, n in batch.items).get("p"))
        run_step(s, batch)
    assert chunks == [31, 31, 31, 7, 1]


def test_preemption_picks_lowest_priority_latest_and_resumes_first():
    # 5 blocks of 4 tokens; three 4-token prompts take one block each, then every decode needs
    # a second block: only two fit
    s = make(EngineConfig(block_size=4, max_priority_adjust_s=0.0), num_blocks=5)
    a = req("a", prompt_len=4, max_tokens=6, arrival=0.0)
    b = req("b", prompt_len=4, max_tokens=300, arrival=0.1, priority=Priority.LOW)
    c = req("c", prompt_len=4, max_tokens=6, arrival=0.2)
    for r in (a, b, c):
        s.add(r)
    batch = s.schedule(now=0.3)
    assert admitted_ids(batch) == ["a", "c", "b"]  # HIGH first, then LOW
    run_step(s, batch)
    batch = s.schedule(now=0.4)
    assert batch.preempted == [b]  # LOW sorts last, though it arrived before c
    assert batch.admitted == []  # no admission in a step that preempted
    assert b.status == RequestStatus.PREEMPTED and b.block_table == [] and b.num_tokens == 5
    run_step(s, batch)
    s.add(req("n", prompt_len=4, arrival=0.5))
    order = []
    for step in range(20):
        batch = s.schedule(now=0.5 + 0.01 * step)
        order += admitted_ids(batch)
        run_step(s, batch)
        s.bm.check(s.running)
    assert "b" in order and order.index("b") < order.index("n")  # preempted resume before new


def test_preempted_request_resumes_with_prefix_hits():
    s = make(EngineConfig(block_size=4), num_blocks=4)
    a = req("a", prompt_len=9, max_tokens=300, priority=Priority.LOW)
    s.add(a)
    run_step(s, s.schedule(now=0.0))
    blocks_before = list(a.block_table[:2])
    s._preempt(a, ScheduledBatch())
    assert a.status == RequestStatus.PREEMPTED and a.block_table == []
    batch = s.schedule(now=0.1)
    assert batch.admitted == [a]
    assert a.block_table[:2] == blocks_before  # full blocks came back from the prefix cache
    assert dict((r.request_id, n) for r, n in batch.items)["a"] == 2  # only the tail recomputed


@pytest.mark.parametrize("bad", [{"tick_s": 0}, {"utilization_gate": 1.5}, {"max_low_per_tick": 0}])
def test_config_validates_itself(bad):
    from scratchllm.errors import ConfigError

    with pytest.raises(ConfigError):
        EngineConfig(**bad)
