"""Block manager: unit tests of each rule, and a hypothesis state machine that runs random
allocate / append / fork / free / preempt / resume sequences against a model of the K/V pool."""

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from scratchllm.engine.block_manager import BlockManager
from scratchllm.engine.request import Priority, Request
from scratchllm.sampling import SamplingParams

BS = 4


def make_seq(tokens, rid="r"):
    return Request(rid, list(tokens), SamplingParams(max_tokens=4), Priority.HIGH)


def compute(bm, seq, pool=None):
    """What a step does for `seq`: make room, (write K/V), mark computed, register full blocks."""
    copies = bm.ensure_slots(seq, seq.num_tokens)
    if pool is not None:
        for src, dst in copies:
            pool[dst] = list(pool[src])
        for s in range(seq.num_computed_tokens, seq.num_tokens):
            block_id = seq.block_table[s // BS]
            assert bm.blocks[block_id].ref_count == 1, "a write lands only in a private block"
            pool[block_id][s % BS] = seq.token_ids[s]
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_full_blocks(seq)
    return copies


def test_prefix_hit_returns_the_same_blocks_and_leaves_one_token_to_compute():
    bm = BlockManager(16, BS)
    a = make_seq(range(10), "a")  # 2 full blocks + 2 tokens
    assert bm.allocate_prefix(a) == 0
    compute(bm, a)
    b = make_seq(list(range(8)) + [99, 98], "b")
    assert bm.allocate_prefix(b) == 8
    assert b.block_table == a.block_table[:2]
    assert [bm.blocks[i].ref_count for i in b.block_table] == [2, 2]
    c = make_seq(range(8), "c")  # prompt equal to two full blocks: the last block is recomputed
    assert bm.allocate_prefix(c) == 4
    bm.check([a, b, c])


def test_hash_collision_is_caught_by_the_token_check():
    bm = BlockManager(8, BS)
    a = make_seq(range(6), "a")
    bm.allocate_prefix(a)
    compute(bm, a)
    block = bm.blocks[a.block_table[0]]
    block.token_ids = (7, 7, 7, 7)  # the hash now lies about the block's content
    b = make_seq(range(6), "b")
    assert bm.allocate_prefix(b) == 0


def test_freed_blocks_wait_for_the_step_that_reads_them():
    bm = BlockManager(4, BS)
    a = make_seq(range(6), "a")
    bm.allocate_prefix(a)
    compute(bm, a)
    bm.begin_step()
    bm.free(a)  # e.g. an abort arriving while the forward runs
    assert bm.num_free == 2 and len(bm.pending) == 2
    bm.check([])
    bm.end_step()
    assert bm.num_free == 4 and not bm.pending
    bm.check([])


def test_copy_on_write_of_a_shared_partial_block():
    bm = BlockManager(8, BS)
    a = make_seq(range(6), "a")
    bm.allocate_prefix(a)
    compute(bm, a)
    b = make_seq(a.token_ids, "b")
    bm.fork(a, b)
    assert bm.blocks[a.block_table[1]].ref_count == 2
    b.token_ids.append(42)
    copies = compute(bm, b)
    assert copies == [(a.block_table[1], b.block_table[1])]
    assert b.block_table[0] == a.block_table[0] and b.block_table[1] != a.block_table[1]
    bm.check([a, b])


def test_eviction_reuses_least_recently_freed_cached_block_and_drops_its_hash():
    bm = BlockManager(2, BS)
    a = make_seq(range(5), "a")
    bm.allocate_prefix(a)
    compute(bm, a)
    bm.free(a)
    assert len(bm.hash_to_block) == 1
    b = make_seq(range(100, 109), "b")  # needs 3 blocks: can't
    assert not bm.can_allocate(bm.blocks_needed(b, b.num_tokens))
    c = make_seq(range(100, 107), "c")  # 2 blocks: evicts the cached one
    bm.allocate_prefix(c)
    compute(bm, c)
    assert all(bm.blocks[i].token_ids != (0, 1, 2, 3) for i in range(2))
    bm.check([c])


class BlockManagerMachine(RuleBasedStateMachine):
    """Random operations; after each, the invariants hold and every sequence's computed slots
    hold exactly its own tokens in the modelled K/V pool (prefix hits included)."""

    def __init__(self):
        super().__init__()
        self.bm = BlockManager(12, BS)
        self.pool = {i: [None] * BS for i in range(12)}
        self.live: list[Request] = []
        self.preempted: list[Request] = []
        self.n = 0

    def _new_id(self):
        self.n += 1
        return f"s{self.n}"

    def _admit(self, seq) -> bool:
        hit = self.bm.allocate_prefix(seq)
        assert hit % BS == 0 and hit < seq.num_tokens
        if not self.bm.can_allocate(self.bm.blocks_needed(seq, seq.num_tokens)):
            self.bm.free(seq)
            return False
        compute(self.bm, seq, self.pool)
        self.live.append(seq)
        return True

    @rule(tokens=st.lists(st.integers(0, 2), min_size=1, max_size=20))
    def allocate(self, tokens):
        self._admit(make_seq(tokens, self._new_id()))

    @precondition(lambda self: self.live)
    @rule(data=st.data(), token=st.integers(0, 2))
    def append(self, data, token):
        seq = data.draw(st.sampled_from(self.live))
        seq.token_ids.append(token)
        if self.bm.can_allocate(self.bm.blocks_needed(seq, seq.num_tokens)):
            compute(self.bm, seq, self.pool)
        else:
            seq.token_ids.pop()

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(self.live))
        child = make_seq(parent.token_ids, self._new_id())
        self.bm.fork(parent, child)
        self.live.append(child)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), during_step=st.booleans())
    def free(self, data, during_step):
        seq = data.draw(st.sampled_from(self.live))
        self.live.remove(seq)
        if during_step:
            self.bm.begin_step()
        self.bm.free(seq)
        if during_step:
            self.check()
            self.bm.end_step()

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def preempt(self, data):
        seq = data.draw(st.sampled_from(self.live))
        self.live.remove(seq)
        self.bm.free(seq)
        assert not seq.block_table and seq.num_computed_tokens == 0
        self.preempted.append(seq)

    @precondition(lambda self: self.preempted)
    @rule()
    def resume(self):
        seq = self.preempted[0]
        if self._admit(seq):
            self.preempted.pop(0)

    @invariant()
    def check(self):
        self.bm.check(self.live)
        bm = self.bm
        assert bm.num_free + len(bm.pending) + bm.num_used == bm.num_blocks
        for seq in self.live:
            for s in range(seq.num_computed_tokens):
                block_id = seq.block_table[s // BS]
                assert bm.blocks[block_id].ref_count > 0
                assert self.pool[block_id][s % BS] == seq.token_ids[s], "a sequence reads its own K/V"


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_abort_returns_every_block():
    bm = BlockManager(8, BS)
    a = make_seq(range(13), "a")
    bm.allocate_prefix(a)
    compute(bm, a)
    b = make_seq(range(13), "b")
    bm.allocate_prefix(b)
    compute(bm, b)
    bm.free(a)
    bm.free(b)
    assert bm.num_free == 8 and bm.num_used == 0
    bm.check([])


@pytest.mark.parametrize("n", [1, 4, 5, 17])
def test_blocks_needed(n):
    bm = BlockManager(16, BS)
    assert bm.blocks_needed(make_seq(range(n)), n) == -(-n // BS)


def test_recently_freed_plain_blocks_are_reused_before_untouched_ones():
    # a freed block's memory is resident (and warm); an untouched one would grow RSS when first written
    bm = BlockManager(16, BS, enable_prefix_caching=False)
    a = make_seq(range(6), "a")  # 2 blocks
    bm.allocate_prefix(a)
    compute(bm, a)
    first = list(a.block_table)
    assert first == [0, 1]  # untouched blocks go out in id order
    bm.free(a)
    b = make_seq(range(100, 106), "b")
    bm.allocate_prefix(b)
    compute(bm, b)
    assert sorted(b.block_table) == first  # the freed ones, not blocks 2 and 3
    assert bm.stats.peak_used == 2
    bm.check([b])
