"""The KV pool's default size follows the model and the concurrency asked for; an explicit size wins."""

import pytest

from scratchllm.engine.config import EngineConfig
from scratchllm.engine.kv_sizing import KV_DTYPES, resolve_kv_dtype
from scratchllm.engine.memory_plan import DEFAULT_KV_BYTES, plan_memory
from scratchllm.errors import ConfigError
from scratchllm.models import load_model
from tests.models.test_loader import tiny_llama_tensors, write


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_model(write(tmp_path_factory.mktemp("m") / "tiny", tiny_llama_tensors()))


def block_bytes(model, block_size=16):  # K and V, every layer, at the default KV-cache dtype
    c = model.config
    itemsize = KV_DTYPES[resolve_kv_dtype("auto")].itemsize
    return 2 * c.num_layers * block_size * c.num_kv_heads * c.head_dim * itemsize


def test_default_pool_holds_max_num_seqs_full_length_sequences(tiny):
    budget = 1 << 30
    for seqs in (1, 4, 16):
        plan = plan_memory(tiny, EngineConfig(max_num_seqs=seqs, memory_budget_bytes=budget), max_model_len=32)
        assert plan.num_kv_blocks == seqs * 2  # 32 tokens = 2 blocks of 16 per sequence
        assert plan.kv_block_bytes == block_bytes(tiny)


def test_default_pool_is_capped_at_one_gib(tiny):
    plan = plan_memory(tiny, EngineConfig(max_num_seqs=64, memory_budget_bytes=8 << 30), max_model_len=1 << 22)
    assert plan.kv_bytes <= DEFAULT_KV_BYTES and plan.kv_bytes > DEFAULT_KV_BYTES - plan.kv_block_bytes


def test_kv_cache_memory_sizes_the_pool(tiny):
    size = 40 * block_bytes(tiny) + 5  # a partial block is not a block
    plan = plan_memory(tiny, EngineConfig(kv_cache_memory_bytes=size, memory_budget_bytes=1 << 30), max_model_len=32)
    assert plan.num_kv_blocks == 40
    with pytest.raises(ConfigError, match="kv_cache_memory_bytes"):
        EngineConfig(kv_cache_memory_bytes=0)
