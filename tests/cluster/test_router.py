"""The routing decision without Ray: its rule against a reference written from the rule's
statement, its hashes against the engine's own block manager, and the router's view."""

import random
from itertools import takewhile

import hypothesis.strategies as st
from hypothesis import given, settings

from scratchllm.cluster.residency import HashTranslator, PrefixCacheModel
from scratchllm.cluster.router import (
    ReplicaState,
    RoutingPolicy,
    choose,
    power_of_two,
    prefix_hashes,
    round_robin,
)
from scratchllm.cluster.usage import with_cached
from scratchllm.cluster.view import ASSUME_GRACE_S, Accuracy, ClusterView
from scratchllm.engine.block_manager import BlockManager
from scratchllm.engine.request import Priority, Request
from scratchllm.sampling import SamplingParams

BS = 16


def engine_serves(bm: BlockManager, tokens, rid) -> int:
    """Admit `tokens` in the real block manager as the scheduler does; returns its cached tokens."""
    seq = Request(rid, list(tokens), SamplingParams(max_tokens=1), Priority.HIGH)
    cached = bm.allocate_prefix(seq)
    bm.ensure_slots(seq, seq.num_tokens)
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_full_blocks(seq)
    bm.free(seq)
    return cached


def test_prefix_hashes_cover_the_blocks_the_engine_looks_up():
    assert prefix_hashes(list(range(16))) == []  # one block, but its last token must be computed
    assert len(prefix_hashes(list(range(17)))) == 1
    assert len(prefix_hashes(list(range(48)))) == 2 and len(prefix_hashes(list(range(49)))) == 3
    a, b = prefix_hashes(list(range(40))), prefix_hashes(list(range(32)) + [7] * 8)
    assert a[:2] == b[:2]  # same first 32 tokens: same chain
    c = prefix_hashes([99] + list(range(1, 40)))
    assert c[0] != a[0] and c[1] != a[1]  # a change in block 0 changes every later hash (the chain)


def test_a_replica_reporting_translated_engine_hashes_predicts_the_engine_hits_exactly():
    """The replica's report (engine hashes -> routing hashes) against the real prefix cache."""
    rng = random.Random(1)
    bm = BlockManager(64, BS)
    translator = HashTranslator(1024)
    systems = [[rng.randrange(1000) for _ in range(rng.choice([20, 40, 70]))] for _ in range(3)]
    for i in range(40):
        prompt = rng.choice(systems) + [rng.randrange(1000) for _ in range(rng.randrange(1, 30))]
        replica = ReplicaState("r", set(translator.translate(bm.hash_to_block)), 0)
        predicted = replica.leading_run(prefix_hashes(prompt)) * BS
        translator.learn(prompt)
        assert engine_serves(bm, prompt, f"q{i}") == predicted


def test_the_fake_engines_cache_model_agrees_with_the_engine_while_nothing_is_evicted():
    rng = random.Random(2)
    bm, model = BlockManager(512, BS), PrefixCacheModel(512)
    shared = [rng.randrange(500) for _ in range(50)]
    for i in range(30):
        prompt = shared[: rng.randrange(10, 50)] + [rng.randrange(500) for _ in range(rng.randrange(1, 40))]
        assert model.admit(prompt) == engine_serves(bm, prompt, f"q{i}")


def reference_choice(replicas, hashes, rng, min_slack=2, slack_fraction=0.5):
    """The rule as stated in words, written independently of router.choose."""
    runs = {r.replica_id: len(list(takewhile(lambda h, r=r: h in r.resident, hashes))) for r in replicas}
    least = min(r.load for r in replicas)
    longest = max(runs.values())
    holders = sorted((r for r in replicas if runs[r.replica_id] == longest),
                     key=lambda r: (r.load, replicas.index(r)))
    batch_slot = holders[0].capacity is not None and holders[0].load < holders[0].capacity
    if longest > 0 and (batch_slot or holders[0].load - least <= max(min_slack, slack_fraction * least)):
        return holders[0].replica_id
    two = rng.sample(range(len(replicas)), 2) if len(replicas) > 1 else [0]
    a = min(two, key=lambda i: (replicas[i].load, -runs[replicas[i].replica_id]))
    return replicas[a].replica_id


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 6), st.integers(0, 30), st.none() | st.integers(1, 16)), min_size=1,
                max_size=5),
       st.integers(0, 6), st.integers(0, 2**16))
def test_choose_follows_the_stated_rule(replicas, prompt_blocks, seed):
    hashes = list(range(100, 100 + prompt_blocks))
    states = [ReplicaState(f"r{i}", set(hashes[:held]) | {7}, load, capacity)
              for i, (held, load, capacity) in enumerate(replicas)]
    decision = choose(states, hashes, random.Random(seed))
    assert decision.replica_id == reference_choice(states, hashes, random.Random(seed))
    chosen = next(s for s in states if s.replica_id == decision.replica_id)
    assert decision.predicted_cached_tokens == BS * len(list(takewhile(chosen.resident.__contains__, hashes)))


def test_the_holder_loses_its_claim_beyond_the_load_bound():
    hashes = [1, 2, 3]
    holder, idle = ReplicaState("holder", {1, 2, 3}, 2), ReplicaState("idle", set(), 0)
    assert choose([holder, idle], hashes, random.Random(0)).reason == "prefix"  # 2 <= 0 + max(2, 0)
    busy = ReplicaState("holder", {1, 2, 3}, 3)
    d = choose([busy, idle], hashes, random.Random(0))
    assert (d.replica_id, d.reason, d.predicted_cached_tokens) == ("idle", "balance", 0)
    loaded = [ReplicaState("holder", {1, 2, 3}, 15), ReplicaState("idle", set(), 10)]  # 15 <= 10 + 5
    assert choose(loaded, hashes, random.Random(0)).replica_id == "holder"
    over = [ReplicaState("holder", {1, 2, 3}, 16), ReplicaState("idle", set(), 10)]
    assert choose(over, hashes, random.Random(0)).replica_id == "idle"
    strict = RoutingPolicy(min_slack=0, slack_fraction=0.0)
    assert choose([holder, idle], hashes, random.Random(0), strict).replica_id == "idle"


def test_a_holder_with_a_free_batch_slot_keeps_its_claim():
    """One more request joins a batch that has room (no wait) and hits; only a holder whose batch is
    full, beyond the load bound, loses the prompt to an idle replica (which would recompute it)."""
    hashes = [1, 2, 3]
    idle = ReplicaState("idle", set(), 0, capacity=8)
    for load in range(8):  # 3..7 running: beyond the bound of 2, but the batch has room
        d = choose([ReplicaState("holder", {1, 2, 3}, load, capacity=8), idle], hashes, random.Random(0))
        assert (d.replica_id, d.reason, d.predicted_cached_tokens) == ("holder", "prefix", 48)
    full = ReplicaState("holder", {1, 2, 3}, 8, capacity=8)  # the request would wait: the bound decides
    assert choose([full, idle], hashes, random.Random(0)).replica_id == "idle"
    assert choose([full, ReplicaState("busy", set(), 7, 8)], hashes, random.Random(0)).replica_id == "holder"
    unknown = ReplicaState("holder", {1, 2, 3}, 3)  # no capacity reported: the bound alone, as before
    assert choose([unknown, idle], hashes, random.Random(0)).replica_id == "idle"


def test_only_an_unbroken_run_from_the_first_block_counts():
    broken = ReplicaState("broken", {2, 3}, 0)  # holds blocks 2 and 3 but not block 1: no hit
    short = ReplicaState("short", {1}, 0)
    d = choose([broken, short], [1, 2, 3], random.Random(0))
    assert (d.replica_id, d.matched_blocks, d.predicted_cached_tokens) == ("short", 1, 16)


def test_the_baselines_ignore_the_cache():
    states = [ReplicaState("a", {1}, 5), ReplicaState("b", set(), 0), ReplicaState("c", set(), 1)]
    assert [round_robin(states, [1], i).replica_id for i in range(4)] == ["a", "b", "c", "a"]
    picks = {power_of_two(states, [1], random.Random(s)).replica_id for s in range(50)}
    assert picks == {"b", "c"}  # "a" loses every pair it is drawn in: it is the busiest
    same = [power_of_two(states, [1], random.Random(3)).replica_id for _ in range(3)]
    assert len(set(same)) == 1  # deterministic given the seed


def test_the_view_assumes_routed_blocks_until_a_report_and_forgets_the_dead():
    now = [0.0]
    view = ClusterView(seed=0, clock=lambda: now[0])
    prompt = list(range(100))  # 6 blocks to look up
    first = view.route(prompt, ["a", "b"])
    assert first.reason == "balance" and first.predicted_cached_tokens == 0
    second = view.route(prompt, ["a", "b"])  # before any report: the assumed blocks attract it
    assert second.replica_id == first.replica_id and second.predicted_cached_tokens == 6 * BS
    other = "b" if first.replica_id == "a" else "a"
    now[0] = 1.0
    view.report(first.replica_id, [], load=0, made_at=now[0])  # too soon after routing: still assumed
    assert view.route(prompt, ["a", "b"]).replica_id == first.replica_id
    now[0] = 1.0 + ASSUME_GRACE_S + 0.1
    view.report(first.replica_id, [], load=0, made_at=now[0])  # the report says those blocks are gone
    for _ in range(3):
        view.completed(first.replica_id)
    assert view.decide(prompt, ["a", "b"]).predicted_cached_tokens == 0
    view.report(other, prefix_hashes(prompt), load=0)
    assert view.decide(prompt, ["a", "b"]).replica_id == other
    view.forget(other)
    assert view.decide(prompt, ["a", "b"]).predicted_cached_tokens == 0 and view.forgotten == 1


def test_the_view_keeps_a_claim_while_the_reported_batch_has_room():
    view = ClusterView(seed=0)
    prompt = list(range(100))
    view.report("a", prefix_hashes(prompt), load=5, capacity=8)  # 5 running, room for 3 more
    view.report("b", [], load=0, capacity=8)
    assert view.decide(prompt, ["a", "b"]).replica_id == "a"
    view.report("a", prefix_hashes(prompt), load=8, capacity=8)  # full: the request would wait there
    assert view.decide(prompt, ["a", "b"]).replica_id == "b"


def test_a_replica_reports_its_batch_capacity_and_fills_its_pool_with_prefixes(tmp_path):
    from scratchllm.bench.cluster import write_tiny_llama
    from scratchllm.cluster.replica import ReplicaSpec, build_engine

    fake = build_engine(ReplicaSpec("fake", {"max_running": 5}))
    assert fake.capacity == 5
    folder = write_tiny_llama(tmp_path / "m", vocab=64, hidden=32, layers=1, inter=48, ctx=256)
    built = build_engine(ReplicaSpec(str(folder), {"num_kv_blocks": 40, "max_num_seqs": 6}, tokenizer=False))
    try:
        assert built.capacity == 6
        llm = built.engine.engine  # type: ignore[attr-defined]
        # the prefix cache may keep the whole pool: no cap at the peak of blocks held
        assert all(g.residue_cap is None or g.residue_cap >= g.num_blocks for g in llm.block_manager.groups)
    finally:
        built.engine.shutdown(drain=False)


def test_accuracy_and_usage_details():
    acc = Accuracy()
    for predicted, actual in [(32, 32), (0, 0), (16, 0), (0, 16)]:
        acc.add(predicted, actual, 40)
    s = acc.summary()
    assert (s["hit_agreement"], s["exact"], s["actual_hits"], s["hit_agreement_rate"]) == (2, 2, 2, 0.5)
    body = {"id": "cmpl-1", "usage": {"prompt_tokens": 40}}
    assert with_cached(body, {"cmpl-1": 32})["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}
    several = with_cached({"id": "x", "usage": {}}, {"x-0": 16, "x-1": 32})
    assert several["usage"]["prompt_tokens_details"] == {"cached_tokens": 48}
    assert "prompt_tokens_details" not in with_cached({"id": "y", "usage": {}}, {})["usage"]
