"""The block manager: which KV-cache blocks each sequence owns. Ids only; the K/V numbers live
in the paged pool of the attention object (paged_attention.py), indexed by these ids.

A pre-allocated pool of `num_blocks` blocks of `block_size` token slots. Per block a reference
count; per sequence a block table (list of block ids: slot s of the sequence is
table[s // block_size] * block_size + s % block_size).

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


@dataclass
class BlockStats:
    prefix_queries: int = 0  # full blocks looked up
    prefix_hits: int = 0
    cow_copies: int = 0
    peak_used: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def chain_hash(prev_hash: int | None, tokens: Sequence[int]) -> int:
    """The hash of a full block: its tokens chained to every block before it, so equal hashes
    mean (up to collisions, which I4 catches) equal prefixes, not just equal blocks."""
    return hash((prev_hash, tuple(tokens)))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        assert num_blocks >= 1 and block_size >= 1
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks in two O(1) lists: plain ones are reused first, most recently freed first
        # (a stack: its pages are resident and likely in cache, while an untouched block would
        # fault in fresh memory and grow RSS; untouched blocks go out in id order after them);
        # cached ones (still holding a registered prefix) are reused least-recently-freed first (LRU).
        self.free_plain: deque[int] = deque(range(num_blocks - 1, -1, -1))  # pop() takes the right end
        self.free_cached: OrderedDict[int, None] = OrderedDict()
        self.pending: list[int] = []  # ref_count 0, waiting for the in-flight step to end (I3)
        self.hash_to_block: dict[int, int] = {}
        self.in_step = False
        self.stats = BlockStats()

    # --- counts ---
    @property
    def num_free(self) -> int:
        return len(self.free_plain) + len(self.free_cached)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free - len(self.pending)

    @property
    def occupancy(self) -> float:
        return self.num_used / self.num_blocks

    def blocks_needed(self, seq: Request, num_tokens: int) -> int:
        """New blocks `seq` needs for its table to cover `num_tokens` slots, CoW included."""
        need = -(-num_tokens // self.block_size) - len(seq.block_table)
        return max(need, 0) + (1 if self._cow_index(seq, num_tokens) is not None else 0)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free

    # --- the step fence (I3) ---
    def begin_step(self) -> None:
        self.in_step = True

    def end_step(self) -> None:
        self.in_step = False
        for block_id in self.pending:
            self._to_free(block_id)
        self.pending.clear()

    # --- allocation ---
    def _pop_free(self) -> int:
        if self.free_plain:
            block_id = self.free_plain.pop()
        else:
            block_id, _ = self.free_cached.popitem(last=False)  # least recently freed
        block = self.blocks[block_id]
        assert block.ref_count == 0, "only a block at count 0 is reused (I3)"
        if block.hash is not None:  # evict its prefix: its slots are about to be overwritten
            if self.hash_to_block.get(block.hash) == block_id:
                del self.hash_to_block[block.hash]
            block.hash, block.token_ids = None, ()
        block.ref_count = 1
        return block_id

    def _to_free(self, block_id: int) -> None:
        block = self.blocks[block_id]
        assert block.ref_count == 0
        if block.hash is not None:
            self.free_cached[block_id] = None
        else:
            self.free_plain.append(block_id)

    def _take(self, block_id: int) -> None:
        """One more reference to an existing block (a prefix hit or a fork)."""
        block = self.blocks[block_id]
        if block.ref_count == 0:  # a cached block coming back from the free or pending list
            if block_id in self.free_cached:
                del self.free_cached[block_id]
            else:
                self.pending.remove(block_id)
        block.ref_count += 1

    def allocate_prefix(self, seq: Request) -> int:
        """At admission of a sequence with an empty table: take every cached full block that
        holds the start of its tokens. Returns the number of tokens whose K/V is reused.
        At least one token is always left to compute: its forward makes the next token."""
        assert not seq.block_table and seq.num_computed_tokens == 0
        seq.block_hashes = []
        if not self.enable_prefix_caching:
            return 0
        bs, tokens = self.block_size, seq.token_ids
        prev = None
        for i in range((len(tokens) - 1) // bs):
            chunk = tuple(tokens[i * bs : (i + 1) * bs])
            h = chain_hash(prev, chunk)
            self.stats.prefix_queries += 1
            block_id = self.hash_to_block.get(h)
            if block_id is None or self.blocks[block_id].token_ids != chunk:  # I4: check tokens
                break
            self.stats.prefix_hits += 1
            self._take(block_id)
            seq.block_table.append(block_id)
            seq.block_hashes.append(h)
            prev = h
        seq.num_computed_tokens = len(seq.block_table) * bs
        self._note_peak()
        return seq.num_computed_tokens

    def _cow_index(self, seq: Request, num_tokens: int) -> int | None:
        """Index in the table of a shared block the next writes would land in, if any (I5)."""
        first = seq.num_computed_tokens
        if num_tokens <= first:
            return None
        i = first // self.block_size
        if i < len(seq.block_table) and self.blocks[seq.block_table[i]].ref_count > 1:
            return i
        return None

    def ensure_slots(self, seq: Request, num_tokens: int) -> list[tuple[int, int]]:
        """Grow `seq`'s table to cover `num_tokens` slots, copying a shared partial block first.
        Returns the (src, dst) block copies the K/V pool must do before the next forward.
        The caller checked `can_allocate(blocks_needed(...))`."""
        copies: list[tuple[int, int]] = []
        i = self._cow_index(seq, num_tokens)
        if i is not None:
            src = seq.block_table[i]
            dst = self._pop_free()
            self.blocks[src].ref_count -= 1  # still > 0: another table holds it
            seq.block_table[i] = dst
            copies.append((src, dst))
            self.stats.cow_copies += 1
        while len(seq.block_table) * self.block_size < num_tokens:
            seq.block_table.append(self._pop_free())
        # I5: every block that this step writes is private and not a cached full block
        for j in range(seq.num_computed_tokens // self.block_size, len(seq.block_table)):
            block = self.blocks[seq.block_table[j]]
            assert block.ref_count == 1 and block.hash is None, "writes only into private blocks"
        self._note_peak()
        return copies

    def cache_full_blocks(self, seq: Request) -> None:
        """After a step computed K/V: register the sequence's newly full blocks by chained hash."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        num_full = seq.num_computed_tokens // bs
        prev = seq.block_hashes[-1] if seq.block_hashes else None
        for i in range(len(seq.block_hashes), num_full):
            chunk = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            h = chain_hash(prev, chunk)
            block = self.blocks[seq.block_table[i]]
            if block.hash is None and h not in self.hash_to_block:
                block.hash, block.token_ids = h, chunk
                self.hash_to_block[h] = block.block_id
            seq.block_hashes.append(h)
            prev = h

    def fork(self, parent: Request, child: Request) -> None:
        """`child` shares all of `parent`'s blocks (n > 1 sampling); writes will copy-on-write."""
        assert not child.block_table
        for block_id in parent.block_table:
            self._take(block_id)
        child.block_table = list(parent.block_table)
        child.block_hashes = list(parent.block_hashes)
        child.num_computed_tokens = parent.num_computed_tokens

    def free(self, seq: Request) -> None:
        """Drop `seq`'s references (finish, abort or preemption). Tail blocks go first so that
        the prefix, the most reusable part, is evicted last."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            assert block.ref_count > 0, "a block in a table has ref_count > 0 (I2)"
            block.ref_count -= 1
            if block.ref_count == 0:
                if self.in_step:
                    self.pending.append(block_id)  # I3: the running step may still read it
                else:
                    self._to_free(block_id)
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0

    def _note_peak(self) -> None:
        self.stats.peak_used = max(self.stats.peak_used, self.num_used)

    # --- the invariants, checked in full (tests call this after every operation) ---
    def check(self, seqs: Iterable[Request] = ()) -> None:
        free = set(self.free_plain) | set(self.free_cached)
        pending = set(self.pending)
        used = {b.block_id for b in self.blocks if b.ref_count > 0}
        assert len(free) == self.num_free and len(pending) == len(self.pending), "no duplicates"
        assert not (free & pending) and not (free & used) and not (pending & used), "I1"
        assert len(free) + len(pending) + len(used) == self.num_blocks, "I1"
        counts: dict[int, int] = {}
        for seq in seqs:
            for block_id in seq.block_table:
                counts[block_id] = counts.get(block_id, 0) + 1
        for block in self.blocks:
            assert block.ref_count == counts.get(block.block_id, 0), f"I2 block {block.block_id}"
        for h, block_id in self.hash_to_block.items():
            block = self.blocks[block_id]
            assert block.hash == h and len(block.token_ids) == self.block_size, "I4"
