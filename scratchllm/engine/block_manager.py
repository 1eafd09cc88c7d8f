"""The block manager: which KV-cache blocks each sequence owns. Ids only; the K/V numbers live
in the paged pool of the attention object (paged_attention.py), indexed by these ids.

A pre-allocated pool of `num_blocks` blocks of `block_size` token slots. Per block a reference
count; per sequence a block table (list of block ids: slot s of the sequence is
table[s // block_size] * block_size + s % block_size).

Sliding windows (paged_attention.layer_groups): a model whose layers are some full-attention and
some windowed keeps two pools, one per group (a BlockPool each), and two tables per sequence:
Request.block_table for the full-attention layers, Request.window_table for the windowed ones.
A windowed layer with window w: the query at position p reads positions p - w + 1..p only, and
a sequence's future queries are at positions >= num_computed_tokens, so after each step the
windowed blocks wholly before num_computed_tokens - w + 1 are released (their table entries
become DROPPED), and a windowed table holds about w / block_size + 1 live blocks whatever the
context. A model whose every layer is windowed has one pool, windowed, in Request.block_table.
Why two pools rather than one: a block id is the same slots in every layer that reads its
table, so a block the windowed layers no longer read could not be freed while the
full-attention layers still read its slots.

The prefix cache covers both groups with the same chained hashes: a full block is registered in
each group that still holds it, and a released windowed block stays cached (at count 0, LRU) like
any freed one. A hit of k blocks needs, in every group, the blocks that the first query after it
(position k * block_size) reads: all k in the full-attention group, and only those inside the
window in a windowed one (the entries before are DROPPED in the new table). The longest k for
which every group holds them is taken, so a prefix whose windowed blocks were evicted is never
handed out.

Invariants (asserted in `check()`, relied on everywhere):
  I1 every block is in exactly one place: used (ref_count > 0), free, or pending-free;
     free + pending + used == num_blocks.
  I2 a block in a sequence's table has ref_count > 0, and its ref_count equals the number of
     tables that hold it.
  I3 a block is reused (its K/V overwritten) only from the free list, i.e. at ref_count 0 and only
     after the step that may read it has finished: blocks released while a step is in flight wait
     in `pending` until `end_step()` (the rule: free only after the kernel that reads
     them is done).
  I4 a cached hash maps to a full block whose token ids are those the hash was made from; a hit
     is checked token by token, never trusted on the hash alone.
  I5 slots are written only in a block with ref_count == 1 (a shared block is copied first:
     copy-on-write), and never in a cached full block.
  I6 a DROPPED entry is only in a windowed table, and only before the window of the sequence's
     next query: every block a future query reads is held.
  I7 the resident blocks (ever handed out) are at most the most ever held at once (used or
     pending) plus the prefix cache's residue cap, which by default is that peak again
     (FOLLOW_PEAK): resident <= 2 x the peak held (BlockPool.pop_free says why).
All of them hold in each group's pool.
"""

from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from scratchllm.engine.request import Request


@dataclass(eq=False)
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None  # set once the block is full and registered in the prefix cache
    token_ids: tuple[int, ...] = ()  # the tokens it holds, kept for the hit check (I4)


DROPPED = -1  # a windowed table's entry whose block no future query reads (released)
FOLLOW_PEAK = -1  # residue_blocks: the prefix cache's residue may be as many blocks as the work's peak


@dataclass
class BlockStats:
    prefix_queries: int = 0  # full blocks looked up
    prefix_hits: int = 0
    cow_copies: int = 0
    peak_used: int = 0  # blocks of every group together
    peak_bytes: int = 0  # their KV bytes together, each group's blocks at that group's size
    extra: dict[str, Any] = field(default_factory=dict)


def chain_hash(prev_hash: int | None, tokens: Sequence[int]) -> int:
    """The hash of a full block: its tokens chained to every block before it, so equal hashes
    mean (up to collisions, which I4 catches) equal prefixes, not just equal blocks."""
    return hash((prev_hash, tuple(tokens)))


class BlockPool:
    """One group's blocks: reference counts, the free lists, the step fence and the prefix cache.
    Tables are the manager's (lists of ids); this class only counts."""

    def __init__(self, num_blocks: int, block_size: int, window: int = 0, residue_blocks: int | None = None) -> None:
        assert num_blocks >= 1 and block_size >= 1 and window >= 0
        assert residue_blocks is None or residue_blocks >= 0 or residue_blocks == FOLLOW_PEAK
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.window = window  # 0: the group's layers attend to the whole context
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Where a new block comes from, in this order (pop_free), so that the pool's resident
        # memory follows the work: a block's pages become resident when it is first written and
        # stay so, and an untouched block costs address space only.
        #   1. free_plain: freed blocks that hold nothing cached, most recently freed first (a
        #      stack: resident, and likely still in the CPU's caches);
        #   2. free_cached: freed blocks still holding a registered prefix, least recently freed
        #      first (LRU), evicted here once they number the residue cap or more (residue_blocks;
        #      FOLLOW_PEAK: the most blocks held at once so far; None: no cap), or when no
        #      untouched block is left;
        #   3. untouched blocks, in id order: ids fresh..num_blocks - 1 were never handed out.
        # So the resident blocks are at most the peak held (used + pending) + the cap: the prefix
        # cache's residue lives in memory the work made resident, and under its own cap beyond
        # it (without the cap, a server's idle prefixes would fault in the whole pool).
        self.free_plain: deque[int] = deque()  # pop() takes the right end: the last freed
        self.free_cached: OrderedDict[int, None] = OrderedDict()
        self.fresh = 0
        self.residue_blocks = residue_blocks
        self.pending: list[int] = []  # ref_count 0, waiting for the in-flight step to end (I3)
        self.hash_to_block: dict[int, int] = {}
        self.in_step = False
        self.peak_used = 0
        self.peak_held = 0  # most blocks used or pending at once

    @property
    def num_free(self) -> int:
        return len(self.free_plain) + len(self.free_cached) + self.num_untouched

    @property
    def residue_cap(self) -> int | None:
        """Cached free blocks beyond which untouched memory is not used for new work (None: no cap)."""
        return self.peak_held if self.residue_blocks == FOLLOW_PEAK else self.residue_blocks

    @property
    def num_untouched(self) -> int:
        """Blocks never handed out: their memory is not resident."""
        return self.num_blocks - self.fresh

    @property
    def num_resident(self) -> int:
        """Blocks ever handed out (their pages were written, and stay resident)."""
        return self.fresh

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free - len(self.pending)

    def first_read(self, position: int) -> int:
        """Index of the first block the query at `position` reads (0 without a window)."""
        return max(0, position - self.window + 1) // self.block_size if self.window else 0

    def end_step(self) -> None:
        self.in_step = False
        for block_id in self.pending:
            self._to_free(block_id)
        self.pending.clear()

    def pop_free(self) -> int:
        cap = self.residue_cap
        if self.free_plain:
            block_id = self.free_plain.pop()
        elif self.free_cached and (not self.num_untouched or (cap is not None and len(self.free_cached) >= cap)):
            block_id, _ = self.free_cached.popitem(last=False)  # least recently freed
        else:
            assert self.num_untouched, "the caller checked can_allocate"
            block_id = self.fresh
            self.fresh += 1
        block = self.blocks[block_id]
        assert block.ref_count == 0, "only a block at count 0 is reused (I3)"
        if block.hash is not None:  # evict its prefix: its slots are about to be overwritten
            if self.hash_to_block.get(block.hash) == block_id:
                del self.hash_to_block[block.hash]
            block.hash, block.token_ids = None, ()
        block.ref_count = 1
        self.peak_used = max(self.peak_used, self.num_used)
        self.peak_held = max(self.peak_held, self.num_used + len(self.pending))
        return block_id

    def _to_free(self, block_id: int) -> None:
        block = self.blocks[block_id]
        assert block.ref_count == 0
        if block.hash is not None:
            self.free_cached[block_id] = None
        else:
            self.free_plain.append(block_id)

    def take(self, block_id: int) -> None:
        """One more reference to an existing block (a prefix hit or a fork)."""
        block = self.blocks[block_id]
        if block.ref_count == 0:  # a cached block coming back from the free or pending list
            if block_id in self.free_cached:
                del self.free_cached[block_id]
            else:
                self.pending.remove(block_id)
        block.ref_count += 1
        self.peak_used = max(self.peak_used, self.num_used)
        self.peak_held = max(self.peak_held, self.num_used + len(self.pending))

    def release(self, block_id: int) -> None:
        """One reference fewer; at 0 the block is free (after the step in flight, I3)."""
        block = self.blocks[block_id]
        assert block.ref_count > 0, "a block in a table has ref_count > 0 (I2)"
        block.ref_count -= 1
        if block.ref_count == 0:
            if self.in_step:
                self.pending.append(block_id)  # I3: the running step may still read it
            else:
                self._to_free(block_id)

    def cached(self, h: int, chunk: tuple[int, ...]) -> int | None:
        """The block registered under hash h, if its tokens are `chunk` (I4: checked, not trusted)."""
        block_id = self.hash_to_block.get(h)
        if block_id is None or self.blocks[block_id].token_ids != chunk:
            return None
        return block_id

    def register(self, block_id: int, h: int, chunk: tuple[int, ...]) -> None:
        block = self.blocks[block_id]
        if block.hash is None and h not in self.hash_to_block:
            block.hash, block.token_ids = h, chunk
            self.hash_to_block[h] = block_id

    def check(self, tables: Iterable[list[int]]) -> None:
        free = set(self.free_plain) | set(self.free_cached) | set(range(self.fresh, self.num_blocks))
        pending = set(self.pending)
        used = {b.block_id for b in self.blocks if b.ref_count > 0}
        assert len(free) == self.num_free and len(pending) == len(self.pending), "no duplicates"
        assert not (free & pending) and not (free & used) and not (pending & used), "I1"
        assert len(free) + len(pending) + len(used) == self.num_blocks, "I1"
        counts: dict[int, int] = {}
        for table in tables:
            for block_id in table:
                if block_id != DROPPED:
                    counts[block_id] = counts.get(block_id, 0) + 1
        for block in self.blocks:
            assert block.ref_count == counts.get(block.block_id, 0), f"I2 block {block.block_id}"
        for h, block_id in self.hash_to_block.items():
            block = self.blocks[block_id]
            assert block.hash == h and len(block.token_ids) == self.block_size, "I4"
        assert all(b < self.fresh for b in used | pending | set(self.free_plain) | set(self.free_cached)), \
            "I7: only ids below fresh were ever handed out"
        cap = self.residue_cap
        if cap is not None:
            assert self.num_resident <= self.peak_held + cap, "I7: resident <= peak held + residue cap"


class BlockManager:
    """The blocks of every sequence, in one pool per layer group.

    `window` 0: one pool, full attention (the model has no windows). `window` > 0 and
    `num_window_blocks` None: one pool, every layer windowed. Both: a full-attention pool of
    `num_blocks` and a windowed one of `num_window_blocks`. `residue_blocks`: the cap of each pool's
    cached free blocks beyond its resident work (BlockPool.pop_free); FOLLOW_PEAK: the most blocks
    the pool's work has held at once; None: no cap."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, window: int = 0,
                 num_window_blocks: int | None = None, block_bytes: tuple[int, ...] = (),
                 residue_blocks: int | None = None) -> None:
        assert num_blocks >= 1 and block_size >= 1
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        if window and num_window_blocks is not None:
            self.groups = [BlockPool(num_blocks, block_size, residue_blocks=residue_blocks),
                           BlockPool(num_window_blocks, block_size, window, residue_blocks)]
        else:
            self.groups = [BlockPool(num_blocks, block_size, window, residue_blocks)]
        # KV bytes of one block of each group (the groups' layers differ in count): () = not known
        assert not block_bytes or len(block_bytes) == len(self.groups), (block_bytes, len(self.groups))
        self.block_bytes = block_bytes
        self.stats = BlockStats()

    # --- the first group's pool (the only one of a model without windows) ---
    @property
    def blocks(self) -> list[Block]:
        return self.groups[0].blocks

    @property
    def free_plain(self) -> deque[int]:
        return self.groups[0].free_plain

    @property
    def pending(self) -> list[int]:
        return self.groups[0].pending

    @property
    def hash_to_block(self) -> dict[int, int]:
        return self.groups[0].hash_to_block

    # --- counts, over every group ---
    @property
    def num_blocks(self) -> int:
        return sum(g.num_blocks for g in self.groups)

    @property
    def num_free(self) -> int:
        return sum(g.num_free for g in self.groups)

    @property
    def num_used(self) -> int:
        return sum(g.num_used for g in self.groups)

    @property
    def num_resident(self) -> int:
        """Blocks whose memory the work has made resident (ever handed out), every group."""
        return sum(g.num_resident for g in self.groups)

    @property
    def num_cached_free(self) -> int:
        """Free blocks that still hold a prefix-cache entry (the cache's residue)."""
        return sum(len(g.free_cached) for g in self.groups)

    @property
    def occupancy(self) -> float:
        """Used / total of the fullest pool: memory is spent when either is."""
        return max(g.num_used / g.num_blocks for g in self.groups)

    def tables(self, seq: Request) -> list[list[int]]:
        """`seq`'s table in each group: block_table, then window_table."""
        return [seq.block_table, seq.window_table][: len(self.groups)]

    def blocks_needed(self, seq: Request, num_tokens: int) -> tuple[int, ...]:
        """New blocks `seq` needs, per group, for its tables to cover `num_tokens` slots, CoW included."""
        need = []
        for g, table in enumerate(self.tables(seq)):
            grow = max(-(-num_tokens // self.block_size) - len(table), 0)
            need.append(grow + (1 if self._cow_index(g, seq, num_tokens) is not None else 0))
        return tuple(need)

    def can_allocate(self, needed: Sequence[int], reserve: int = 0) -> bool:
        """Whether each group has its `needed` blocks free, and `reserve` more besides."""
        return all(n + reserve <= g.num_free for n, g in zip(needed, self.groups, strict=True))

    # --- the step fence (I3) ---
    def begin_step(self) -> None:
        for g in self.groups:
            g.in_step = True

    def end_step(self) -> None:
        for g in self.groups:
            g.end_step()

    # --- allocation ---
    def allocate_prefix(self, seq: Request) -> int:
        """At admission of a sequence with empty tables: take the cached full blocks that hold the
        start of its tokens, in every group the ones the next query reads. Returns the number of
        tokens whose K/V is reused. At least one token is always left to compute: its forward
        makes the next token."""
        assert not seq.block_table and not seq.window_table and seq.num_computed_tokens == 0
        seq.block_hashes = []
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return 0  # (prompt logprobs need every prompt position computed, none taken from the cache)
        bs, tokens = self.block_size, seq.token_ids
        hashes: list[int] = []
        hits: list[list[int | None]] = [[] for _ in self.groups]  # per group, per block
        prev = None
        for i in range((len(tokens) - 1) // bs):
            chunk = tuple(tokens[i * bs : (i + 1) * bs])
            h = chain_hash(prev, chunk)
            self.stats.prefix_queries += 1
            for g, pool in enumerate(self.groups):
                hits[g].append(pool.cached(h, chunk))
            hashes.append(h)
            prev = h
            if not self.groups[0].window and hits[0][-1] is None:  # full attention reads every block
                break
        k = len(hashes)
        while k and not all(all(hit[i] is not None for i in range(pool.first_read(k * bs), k))
                            for pool, hit in zip(self.groups, hits, strict=True)):
            k -= 1
        self.stats.prefix_hits += k
        for pool, hit, table in zip(self.groups, hits, self.tables(seq), strict=True):
            first = pool.first_read(k * bs)
            table.extend([DROPPED] * first)
            for block_id in hit[first:k]:
                assert block_id is not None
                pool.take(block_id)
                table.append(block_id)
        seq.block_hashes = hashes[:k]
        seq.num_computed_tokens = k * bs
        self._note_peak()
        return seq.num_computed_tokens

    def _cow_index(self, g: int, seq: Request, num_tokens: int) -> int | None:
        """Index in group g's table of a shared block the next writes would land in, if any (I5)."""
        first = seq.num_computed_tokens
        if num_tokens <= first:
            return None
        i, table = first // self.block_size, self.tables(seq)[g]
        if i < len(table) and self.groups[g].blocks[table[i]].ref_count > 1:
            return i
        return None

    def ensure_slots(self, seq: Request, num_tokens: int) -> list[tuple[int, int, int]]:
        """Grow `seq`'s tables to cover `num_tokens` slots, copying a shared partial block first.
        Returns the (group, src, dst) block copies the K/V pools must do before the next forward.
        The caller checked `can_allocate(blocks_needed(...))`."""
        copies: list[tuple[int, int, int]] = []
        for g, (pool, table) in enumerate(zip(self.groups, self.tables(seq), strict=True)):
            i = self._cow_index(g, seq, num_tokens)
            if i is not None:
                src = table[i]
                dst = pool.pop_free()
                pool.blocks[src].ref_count -= 1  # still > 0: another table holds it
                table[i] = dst
                copies.append((g, src, dst))
                self.stats.cow_copies += 1
            while len(table) * self.block_size < num_tokens:
                table.append(pool.pop_free())
            # I5: every block that this step writes is private and not a cached full block
            for j in range(seq.num_computed_tokens // self.block_size, len(table)):
                block = pool.blocks[table[j]]
                assert block.ref_count == 1 and block.hash is None, "writes only into private blocks"
        self._note_peak()
        return copies

    def cache_full_blocks(self, seq: Request) -> None:
        """After a step computed K/V: register the sequence's newly full blocks by chained hash, in
        every group that holds them."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        num_full = seq.num_computed_tokens // bs
        prev = seq.block_hashes[-1] if seq.block_hashes else None
        for i in range(len(seq.block_hashes), num_full):
            chunk = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            h = chain_hash(prev, chunk)
            for pool, table in zip(self.groups, self.tables(seq), strict=True):
                if table[i] != DROPPED:
                    pool.register(table[i], h, chunk)
            seq.block_hashes.append(h)
            prev = h

    def release_outside_window(self, seq: Request) -> int:
        """After a step: release the windowed blocks that no future query of `seq` reads (every one
        is at a position >= num_computed_tokens). Returns how many entries were dropped."""
        dropped = 0
        for pool, table in zip(self.groups, self.tables(seq), strict=True):
            if not pool.window:
                continue
            for i in range(min(pool.first_read(seq.num_computed_tokens), len(table))):
                if table[i] != DROPPED:
                    pool.release(table[i])
                    table[i] = DROPPED
                    dropped += 1
        return dropped

    def fork(self, parent: Request, child: Request) -> None:
        """`child` shares all of `parent`'s blocks (n > 1 sampling); writes will copy-on-write."""
        assert not child.block_table and not child.window_table
        for pool, table, child_table in zip(self.groups, self.tables(parent), self.tables(child), strict=True):
            for block_id in table:
                if block_id != DROPPED:
                    pool.take(block_id)
            child_table.extend(table)
        child.block_hashes = list(parent.block_hashes)
        child.num_computed_tokens = parent.num_computed_tokens

    def free(self, seq: Request) -> None:
        """Drop `seq`'s references (finish, abort or preemption). Tail blocks go first so that
        the prefix, the most reusable part, is evicted last."""
        for pool, table in zip(self.groups, self.tables(seq), strict=True):
            for block_id in reversed(table):
                if block_id != DROPPED:
                    pool.release(block_id)
            table.clear()
        seq.block_hashes = []
        seq.num_computed_tokens = 0

    @property
    def bytes_used(self) -> int:
        """KV bytes of the blocks in use, each group's at its own block size (0 when not known)."""
        return sum(g.num_used * b for g, b in zip(self.groups, self.block_bytes, strict=False))

    def _note_peak(self) -> None:
        self.stats.peak_used = max(self.stats.peak_used, self.num_used)
        self.stats.peak_bytes = max(self.stats.peak_bytes, self.bytes_used)

    # --- the invariants, checked in full (tests call this after every operation) ---
    def check(self, seqs: Iterable[Request] = ()) -> None:
        seqs = list(seqs)
        for g, pool in enumerate(self.groups):
            tables = [self.tables(seq)[g] for seq in seqs]
            pool.check(tables)
            for seq, table in zip(seqs, tables, strict=True):  # I6
                first = pool.first_read(seq.num_computed_tokens)
                assert all(b != DROPPED for b in table[first:]), "I6: a block a future query reads is held"
                assert pool.window or DROPPED not in table, "I6: only windowed tables drop blocks"
