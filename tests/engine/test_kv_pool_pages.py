"""The KV pool makes resident exactly the blocks a run writes, and a later run reuses the
blocks an earlier one freed before touching new ones, even those that hold cached prefixes
(beyond the prefix cache's own cap): pages counted by the kernel (mincore). The pools here are
float32, so that one block of one layer is one page."""

import mmap

import pytest

from scratchllm.engine import EngineConfig, LLMEngine
from scratchllm.models.arena import resident_bytes
from scratchllm.sampling import SamplingParams

from .tiny import tiny_llama

# 2 KV heads x 32 dims x 16 slots x 4 bytes (float32): one block of one layer is one 4 KiB page for
# K and one for V, and the first token written into a block touches both
KV_HEADS, HEAD_DIM, BLOCK = 2, 32, 16


@pytest.fixture(scope="module")
def model():
    assert KV_HEADS * HEAD_DIM * BLOCK * 4 == mmap.PAGESIZE == 4096
    return tiny_llama(hidden=128, heads=4, kv_heads=KV_HEADS, layers=2)


def pool_resident(engine) -> int:
    return sum(resident_bytes(a) for a in engine.runner.attention.arrays())


def config(**options):
    return EngineConfig(num_kv_blocks=256, block_size=BLOCK, kv_cache_dtype="float32", **options)


def blocks_written(prompt_lens, new_tokens) -> int:
    # the last sampled token's K/V is never computed: prompt + new - 1 slots per sequence
    return sum(-(-(n + new_tokens - 1) // BLOCK) for n in prompt_lens)


def run(engine, prompt_lens, new_tokens, first_id=1):
    prompts = [[(first_id + 7 * i + j) % 90 + 1 for j in range(n)] for i, n in enumerate(prompt_lens)]
    engine.generate(prompts, SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True))


@pytest.mark.parametrize("caching", [True, False])
def test_the_pool_is_resident_only_in_the_blocks_written(model, caching):
    engine = LLMEngine(model, config(enable_prefix_caching=caching))
    assert pool_resident(engine) == 0
    lens = [20, 33, 5, 16]
    run(engine, lens, 10)
    page_per_block = 2 * model.config.num_layers * mmap.PAGESIZE  # K and V, every layer
    assert pool_resident(engine) == blocks_written(lens, 10) * page_per_block


def test_a_second_run_reuses_the_freed_blocks_first(model):
    # without prefix caching every freed block is plain: the next run's blocks are those pages
    engine = LLMEngine(model, config(enable_prefix_caching=False))
    run(engine, [40, 40, 40], 8)
    first = pool_resident(engine)
    run(engine, [30, 35, 12], 8, first_id=50)  # 3 + 3 + 2 blocks, fewer than the first run's 9
    assert pool_resident(engine) == first


PAGE_PER_BLOCK = 2 * 2 * mmap.PAGESIZE  # K and V, 2 layers


@pytest.mark.parametrize("residue_blocks, grows_by", [(0, 0), (3, 1), (None, 5)])
def test_cached_prefixes_live_in_the_resident_blocks_under_their_own_cap(model, residue_blocks, grows_by):
    # with prefix caching on, the first run's 9 freed blocks keep 6 prefixes; a second run of other
    # prompts takes 8 blocks: the 3 plain ones, then cached ones (evicted) while `residue_blocks` or
    # more are cached, then untouched memory. None (the default): as many as the work's peak, 9.
    cap = None if residue_blocks is None else residue_blocks * PAGE_PER_BLOCK
    engine = LLMEngine(model, config(prefix_cache_memory_bytes=cap))
    run(engine, [40, 40, 40], 8)  # 9 blocks written, 6 of them full and cached when freed
    first = pool_resident(engine)
    assert first == 9 * PAGE_PER_BLOCK and engine.block_manager.num_cached_free == 6
    run(engine, [30, 35, 12], 8, first_id=50)
    assert pool_resident(engine) == first + grows_by * PAGE_PER_BLOCK
    assert engine.stats().kv_bytes_resident == pool_resident(engine)  # what /metrics reports


@pytest.mark.parametrize("cap_blocks", [None, 4])
def test_the_resident_pool_follows_the_work_over_many_rounds(model, cap_blocks):
    # a soak in miniature: 30 rounds of 3 new prompts each; the work holds at most 9 blocks at once,
    # the prefix cache may keep as many again (the default) or 4: the pool never grows past that.
    # The old order (untouched blocks before any cached one) made 114 of the 256 blocks resident.
    cap = None if cap_blocks is None else cap_blocks * PAGE_PER_BLOCK
    engine = LLMEngine(model, config(prefix_cache_memory_bytes=cap))
    for r in range(30):
        run(engine, [40, 33, 20], 8, first_id=11 * r + 1)
    held = engine.block_manager.stats.peak_used
    assert held <= 9 and pool_resident(engine) <= (held + (cap_blocks or held)) * PAGE_PER_BLOCK
    assert engine.block_manager.num_blocks == 256  # the pool is 256 blocks: most never touched
