"""What a replica tells the router about its KV cache: the routing hashes of its resident blocks.

Two engines, two sources:
  - the continuous engine: its block manager's prefix cache (`hash_to_block`) read by the engine
    thread itself once per step (`ReportingEngine.stats`), so no other thread touches the
    engine. Those hashes are chained from the engine's root (None, whose hash differs per
    process on Python < 3.12), so the replica translates them to routing hashes
    (router.prefix_hashes) with a map it learns from each prompt it admits (`HashTranslator`);
  - the fake engine has no prefix cache, so the replica models one (`PrefixCacheModel`): an LRU
    of as many blocks as the fake's pool, filled at admission. It gives the router (and the
    tests) something real to route on and reports `cached_tokens` as such a cache would.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from scratchllm.cluster.router import BLOCK_SIZE, prefix_hashes
from scratchllm.engine.block_pool import chain_hash
from scratchllm.engine.engine import LLMEngine
from scratchllm.engine.protocol import EngineStats

REPORT_CAP = 16384  # at most this many hashes per report: 8 bytes each, 128 KiB


class ReportingEngine(LLMEngine):
    """The continuous engine whose per-step stats snapshot also lists its cached block hashes."""

    def stats(self) -> EngineStats:
        return dataclasses.replace(super().stats(), resident_block_hashes=tuple(self.block_manager.hash_to_block))


class HashTranslator:
    """engine block hash -> routing hash, for the full blocks of the prompts this replica admitted."""

    def __init__(self, capacity: int, block_size: int = BLOCK_SIZE):
        assert capacity >= 1
        self.capacity, self.block_size = capacity, block_size
        self._map: OrderedDict[int, int] = OrderedDict()

    def learn(self, token_ids: Sequence[int]) -> None:
        bs, prev = self.block_size, None
        ids = list(token_ids)
        routing = prefix_hashes(ids + [0], bs)  # every full block of the prompt (the +1 lifts the engine's -1)
        for i, h in enumerate(routing):
            prev = chain_hash(prev, ids[i * bs : (i + 1) * bs])  # the engine's own chain, from its root
            self._map[prev] = h
            self._map.move_to_end(prev)
        while len(self._map) > self.capacity:
            self._map.popitem(last=False)

    def translate(self, engine_hashes: Iterable[int]) -> list[int]:
        return [r for h in engine_hashes if (r := self._map.get(h)) is not None]


class PrefixCacheModel:
    """An LRU prefix cache of `num_blocks` blocks, in routing hashes (the fake engine's stand-in)."""

    def __init__(self, num_blocks: int, block_size: int = BLOCK_SIZE):
        assert num_blocks >= 1
        self.num_blocks, self.block_size = num_blocks, block_size
        self._lru: OrderedDict[int, None] = OrderedDict()

    def admit(self, token_ids: Sequence[int]) -> int:
        """Prompt tokens this cache serves (the engine's rule: an unbroken run from the first
        block, one token always left to compute); then the prompt's full blocks are cached."""
        run = 0
        for h in prefix_hashes(token_ids, self.block_size):
            if h not in self._lru:
                break
            run += 1
        for h in prefix_hashes(list(token_ids) + [0], self.block_size):
            self._lru[h] = None
            self._lru.move_to_end(h)
        while len(self._lru) > self.num_blocks:
            self._lru.popitem(last=False)
        return run * self.block_size

    def resident(self) -> list[int]:
        return list(self._lru)
