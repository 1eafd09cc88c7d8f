"""The block pool of one layer group: the KV-cache blocks as ids, their reference counts, where a
free block comes from, the step fence that defers a free, and the prefix cache's hash table.
The tables that say which sequence holds which blocks are the manager's (block_manager.py);
this module only counts. The K/V numbers live in the paged pool of the attention object
(paged_attention.py), indexed by these ids.

Invariants (asserted in `BlockPool.check()`, with the tables the manager hands it):
  I1 every block is in exactly one place: used (ref_count > 0), free, or pending-free;
     free + pending + used == num_blocks.
  I2 (the count half) a block's ref_count equals the number of tables that hold it.
  I3 a block is reused (its K/V overwritten) only from the free list, i.e. at ref_count 0 and only
     after the step that may read it has finished: blocks released while a step is in flight wait
     in `pending` until `end_step()` (the rule: free only after the kernel that reads
     them is done).
  I4 a cached hash maps to a full block whose token ids are those the hash was made from; a hit
     is checked token by token, never trusted on the hash alone.
  I7 the resident blocks (ever handed out) are at most the most ever held at once (used or
     pending) plus the prefix cache's residue cap, which by default is that peak again
     (FOLLOW_PEAK): resident <= 2 x the peak held (BlockPool.pop_free says why).
"""

from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(eq=False)
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None  # set once the block is full and registered in the prefix cache
    token_ids: tuple[int, ...] = ()  # the tokens it holds, kept for the hit check (I4)


DROPPED = -1  # a windowed table's entry whose block no future query reads (released)
FOLLOW_PEAK = -1  # residue_blocks: the prefix cache's residue may be as many blocks as the work's peak


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
