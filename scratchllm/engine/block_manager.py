"""The block manager: which KV-cache blocks each sequence owns, over one block pool per layer
group (block_pool.py: the ids, their counts, the free lists and the prefix cache's hashes).

A pre-allocated pool of `num_blocks` blocks of `block_size` token slots. Per block a reference
count (the pool's); per sequence a block table (list of block ids: slot s of the sequence is
table[s // block_size] * block_size + s % block_size).

Sliding windows (kv_sizing.layer_groups): a model whose layers are some full-attention and
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

Invariants (asserted in `check()`, relied on everywhere); I1, I3, I4 and I7 are the pool's
(block_pool.py), checked there with this manager's tables:
  I2 a block in a sequence's table has ref_count > 0, and its ref_count equals the number of
     tables that hold it.
  I5 slots are written only in a block with ref_count == 1 (a shared block is copied first:
     copy-on-write), and never in a cached full block.
  I6 a DROPPED entry is only in a windowed table, and only before the window of the sequence's
     next query: every block a future query reads is held.
All of them hold in each group's pool.
"""

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from scratchllm.engine.block_pool import DROPPED, Block, BlockPool, chain_hash
from scratchllm.engine.request import Request


@dataclass
class BlockStats:
    prefix_queries: int = 0  # full blocks looked up
    prefix_hits: int = 0
    cow_copies: int = 0
    peak_used: int = 0  # blocks of every group together
    peak_bytes: int = 0  # their KV bytes together, each group's blocks at that group's size
    extra: dict[str, Any] = field(default_factory=dict)


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

    def trim(self, seq: Request) -> int:
        """Release the blocks past the sequence's tokens: after a verification, the ones that held
        only rejected drafts' slots. Returns how many went back."""
        keep = -(-seq.num_tokens // self.block_size)
        released = 0
        for pool, table in zip(self.groups, self.tables(seq), strict=True):
            while len(table) > keep:
                block_id = table.pop()
                if block_id != DROPPED:
                    pool.release(block_id)
                    released += 1
        return released

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
