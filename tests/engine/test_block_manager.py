"""Block manager: unit tests of each rule, and a hypothesis state machine that runs random
allocate / append / fork / free / preempt / resume sequences against a model of the K/V pool,
with one pool (full attention) and with a full-attention and a windowed pool (sliding windows)."""

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from scratchllm.engine.block_manager import BlockManager
from scratchllm.engine.block_pool import DROPPED, FOLLOW_PEAK
from scratchllm.engine.request import Priority, Request
from scratchllm.sampling import SamplingParams

BS = 4


def make_seq(tokens, rid="r"):
    return Request(rid, list(tokens), SamplingParams(max_tokens=4), Priority.HIGH)


def compute(bm, seq, pools=None, upto=None):
    """What a step does for `seq`: make room, (write K/V: pools[group][block][slot] = token), mark
    computed, register full blocks, release the windowed blocks no later query reads."""
    upto = seq.num_tokens if upto is None else upto
    copies = bm.ensure_slots(seq, upto)
    if pools is not None:
        for g, src, dst in copies:
            pools[g][dst] = list(pools[g][src])
        for g, table in enumerate(bm.tables(seq)):
            for s in range(seq.num_computed_tokens, upto):
                block_id = table[s // BS]
                assert bm.groups[g].blocks[block_id].ref_count == 1, "a write lands only in a private block"
                pools[g][block_id][s % BS] = seq.token_ids[s]
    seq.num_computed_tokens = upto
    bm.cache_full_blocks(seq)
    bm.release_outside_window(seq)
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
    assert copies == [(0, a.block_table[1], b.block_table[1])]
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
    that its next query reads hold exactly its own tokens in the modelled K/V pools (prefix hits
    included): all of them in the full-attention group, the last WINDOW in the windowed one."""

    WINDOW = 0  # the windowed subclass: a second pool for layers with this window
    # the prefix cache's residue beyond the resident work: BlockManager.check asserts the resident
    # blocks stay within the peak held + this (I7), so the allocation order is checked each step
    RESIDUE: int | None = 2

    def __init__(self):
        super().__init__()
        window_blocks = 8 if self.WINDOW else None
        self.bm = BlockManager(12, BS, window=self.WINDOW, num_window_blocks=window_blocks,
                               residue_blocks=self.RESIDUE)
        self.pools = [{i: [None] * BS for i in range(g.num_blocks)} for g in self.bm.groups]
        self.live: list[Request] = []
        self.preempted: list[Request] = []
        self.n = 0

    def _new_id(self):
        self.n += 1
        return f"s{self.n}"

    def _admit(self, seq) -> bool:
        hit = self.bm.allocate_prefix(seq)
        assert hit % BS == 0 and hit < seq.num_tokens
        # a prefill in chunks of up to 5 tokens, as the scheduler's token budget cuts it
        while seq.num_computed_tokens < seq.num_tokens:
            upto = min(seq.num_tokens, seq.num_computed_tokens + 5)
            if not self.bm.can_allocate(self.bm.blocks_needed(seq, upto)):
                self.bm.free(seq)
                return False
            compute(self.bm, seq, self.pools, upto)
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
            compute(self.bm, seq, self.pools)
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
        assert not seq.block_table and not seq.window_table and seq.num_computed_tokens == 0
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
        assert bm.num_free + sum(len(g.pending) for g in bm.groups) + bm.num_used == bm.num_blocks
        for seq in self.live:
            for g, table in enumerate(bm.tables(seq)):
                window = bm.groups[g].window
                first = max(0, seq.num_computed_tokens - window + 1) if window else 0  # the next query's
                for s in range(first, seq.num_computed_tokens):
                    block_id = table[s // BS]
                    assert block_id != DROPPED and bm.groups[g].blocks[block_id].ref_count > 0
                    assert self.pools[g][block_id][s % BS] == seq.token_ids[s], "a sequence reads its own K/V"
                if window:  # the bound: the window plus the block being filled
                    assert sum(b != DROPPED for b in table) <= -(-(window - 1) // BS) + 1


class WindowedBlockManagerMachine(BlockManagerMachine):
    WINDOW = 6  # 1.5 blocks: windows that start inside a block
    RESIDUE = FOLLOW_PEAK  # the engine's default: as many cached blocks as the work's peak


class UncappedBlockManagerMachine(BlockManagerMachine):
    RESIDUE = None  # untouched blocks before any cached one is evicted


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestWindowedBlockManagerMachine = WindowedBlockManagerMachine.TestCase
TestWindowedBlockManagerMachine.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
TestUncappedBlockManagerMachine = UncappedBlockManagerMachine.TestCase
TestUncappedBlockManagerMachine.settings = settings(max_examples=20, stateful_step_count=40, deadline=None)


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
    assert bm.blocks_needed(make_seq(range(n)), n) == (-(-n // BS),)
    windowed = BlockManager(16, BS, window=8, num_window_blocks=6)
    assert windowed.blocks_needed(make_seq(range(n)), n) == (-(-n // BS),) * 2  # a prefill writes every slot


def test_windowed_blocks_are_released_once_no_query_reads_them():
    bm = BlockManager(16, BS, window=6, num_window_blocks=8)
    a = make_seq(range(10), "a")
    bm.allocate_prefix(a)
    compute(bm, a)  # the next query, at position 10, reads 5..10: blocks 1 and 2
    assert len(a.block_table) == 3 and a.window_table[0] == DROPPED and DROPPED not in a.window_table[1:]
    assert bm.groups[1].num_used == 2 and bm.groups[0].num_used == 3
    for t in range(30):  # decode 30 tokens: the windowed pool stays at the window's blocks
        a.token_ids.append(t)
        compute(bm, a)
        assert bm.groups[1].num_used <= -(-(6 - 1) // BS) + 1
        bm.check([a])
    assert bm.groups[0].num_used == -(-a.num_tokens // BS)  # the full-attention pool grows with the context
    bm.free(a)
    assert bm.num_used == 0
    bm.check([])


def test_prefix_hit_takes_only_the_window_and_stops_where_it_was_evicted():
    bm = BlockManager(32, BS, window=6, num_window_blocks=8)
    a = make_seq(range(22), "a")  # 5 full blocks + 2 tokens
    bm.allocate_prefix(a)
    for upto in (5, 10, 15, 20, 22):
        compute(bm, a, upto=upto)
    # full blocks 0..4 are registered in both pools; a's next query (22) reads 17..22, so its
    # windowed blocks 0..3 were released (cached, at count 0) and 4 and 5 are held
    assert a.window_table[:4] == [DROPPED] * 4
    b = make_seq(list(range(20)) + [99, 98], "b")
    assert bm.allocate_prefix(b) == 20  # the next query (20) reads 15..20: windowed blocks 3, 4
    assert b.block_table == a.block_table[:5]
    assert b.window_table[:3] == [DROPPED] * 3 and b.window_table[4] == a.window_table[4]
    assert bm.groups[1].blocks[b.window_table[3]].token_ids == (12, 13, 14, 15)  # back from the free list
    bm.check([a, b])
    bm.free(a)
    bm.free(b)
    # evict every cached windowed block but the first ones: fill the windowed pool
    c = make_seq(range(100, 132), "c")
    bm.allocate_prefix(c)
    for upto in range(4, 33, 4):
        compute(bm, c, upto=upto)
    bm.free(c)
    d = make_seq(list(range(20)) + [7], "d")
    hit = bm.allocate_prefix(d)
    for g, table in enumerate(bm.tables(d)):  # whatever the hit, every block its next query reads is held
        pool = bm.groups[g]
        for i in range(pool.first_read(hit), hit // BS):
            assert table[i] != DROPPED and pool.blocks[table[i]].token_ids == tuple(d.token_ids[i * BS : (i + 1) * BS])
    assert hit < 20  # the windowed blocks 3 and 4 of the prefix were evicted by c
    bm.check([d])


def test_fork_shares_a_windowed_table_with_its_dropped_entries():
    bm = BlockManager(16, BS, window=4, num_window_blocks=8)
    a = make_seq(range(13), "a")
    bm.allocate_prefix(a)
    compute(bm, a)
    b = make_seq(a.token_ids, "b")
    bm.fork(a, b)
    assert b.window_table == a.window_table and a.window_table.count(DROPPED) == 2
    bm.check([a, b])
    b.token_ids.append(5)
    copies = compute(bm, b)
    assert (1, a.window_table[3], b.window_table[3]) in copies  # copy-on-write in the windowed pool
    bm.check([a, b])


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


def run_and_free(bm, first_token, n_tokens):
    seq = make_seq(range(first_token, first_token + n_tokens), f"s{first_token}")
    bm.allocate_prefix(seq)
    compute(bm, seq)
    bm.free(seq)
    return seq


@pytest.mark.parametrize("residue, resident_after", [(0, 3), (2, 4), (3, 5), (4, 6), (None, 6), (FOLLOW_PEAK, 5)])
def test_prefix_cache_residue_is_capped_beyond_the_resident_work(residue, resident_after):
    # a 12-token run fills 3 blocks, all registered; a second run with other tokens needs 3 more:
    # it takes untouched memory only while fewer than `residue` cached blocks are free (the rest is
    # evicted first): resident <= the blocks the work holds + residue
    bm = BlockManager(16, BS, residue_blocks=residue)
    run_and_free(bm, 0, 12)
    assert bm.num_resident == 3 and bm.num_cached_free == 3
    run_and_free(bm, 100, 12)
    assert bm.num_resident == resident_after
    bm.check([])


def test_a_capped_cache_still_hits_what_it_holds():
    bm = BlockManager(16, BS, residue_blocks=0)
    run_and_free(bm, 0, 13)  # 3 full blocks registered and a partial one (plain)
    again = make_seq(range(0, 13), "again")
    assert bm.allocate_prefix(again) == 12
    compute(bm, again)
    assert bm.num_resident == 4
    bm.check([again])
