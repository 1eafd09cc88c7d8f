"""The KV pool makes resident exactly the blocks a run writes, and a later run reuses the
blocks an earlier one freed before touching new ones: pages counted by the kernel (mincore)."""

import mmap

import pytest

from scratchllm.engine import EngineConfig, LLMEngine
from scratchllm.models.arena import resident_bytes
from scratchllm.sampling import SamplingParams

from .tiny import tiny_llama

# 2 KV heads x 32 dims x 16 slots x 4 bytes: one block of one layer is one 4 KiB page for K and
# one for V, and the first token written into a block touches both
KV_HEADS, HEAD_DIM, BLOCK = 2, 32, 16


@pytest.fixture(scope="module")
def model():
    assert KV_HEADS * HEAD_DIM * BLOCK * 4 == mmap.PAGESIZE == 4096
    return tiny_llama(hidden=128, heads=4, kv_heads=KV_HEADS, layers=2)


def pool_resident(engine) -> int:
    a = engine.runner.attention
    return resident_bytes(a.k_cache) + resident_bytes(a.v_cache)


def blocks_written(prompt_lens, new_tokens) -> int:
    # the last sampled token's K/V is never computed: prompt + new - 1 slots per sequence
    return sum(-(-(n + new_tokens - 1) // BLOCK) for n in prompt_lens)


def run(engine, prompt_lens, new_tokens, first_id=1):
    prompts = [[(first_id + 7 * i + j) % 90 + 1 for j in range(n)] for i, n in enumerate(prompt_lens)]
    engine.generate(prompts, SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True))


@pytest.mark.parametrize("caching", [True, False])
def test_the_pool_is_resident_only_in_the_blocks_written(model, caching):
    engine = LLMEngine(model, EngineConfig(num_kv_blocks=256, block_size=BLOCK, enable_prefix_caching=caching))
    assert pool_resident(engine) == 0
    lens = [20, 33, 5, 16]
    run(engine, lens, 10)
    page_per_block = 2 * model.config.num_layers * mmap.PAGESIZE  # K and V, every layer
    assert pool_resident(engine) == blocks_written(lens, 10) * page_per_block


def test_a_second_run_reuses_the_freed_blocks_first(model):
    # without prefix caching every freed block is plain: the next run's blocks are those pages
    engine = LLMEngine(model, EngineConfig(num_kv_blocks=256, block_size=BLOCK, enable_prefix_caching=False))
    run(engine, [40, 40, 40], 8)
    first = pool_resident(engine)
    run(engine, [30, 35, 12], 8, first_id=50)  # 3 + 3 + 2 blocks, fewer than the first run's 9
    assert pool_resident(engine) == first
