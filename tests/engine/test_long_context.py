"""Long contexts in fixed chunks (the flash-decoding split of paged attention): the kernel agrees
with the NumPy reference past one chunk, and a token's output is the same bits whether it runs
alone (its chunks split across the threads), in a batch (each item doing its chunks in turn) or
inside a prefill, at every KV-cache dtype."""

import numpy as np
import pytest

from scratchllm.engine import EngineConfig, LLMEngine
from scratchllm.engine.kv_sizing import KV_DTYPES
from scratchllm.engine.paged_attention import PagedAttention, reference_attention
from scratchllm.sampling import SamplingParams

from .tiny import tiny_llama

H, KVH, D, BS = 6, 2, 16, 16
CONTEXT = 700  # three chunks of 256


def filled(dtype, threads, window=0, seed=0):
    """A pool holding 4 sequences' first CONTEXT positions (written through the kernel), and their tables."""
    rng = np.random.default_rng(seed)
    per = CONTEXT // BS + 2
    attn = PagedAttention(1, 4 * per, BS, KVH, D, num_threads=threads, kv_dtype=dtype,
                          windows=[window] if window else ())
    tables = rng.permutation(4 * per).astype(np.int32).reshape(4, per)
    seq = np.repeat(np.arange(4, dtype=np.int32), CONTEXT)
    pos = np.tile(np.arange(CONTEXT, dtype=np.int32), 4)
    attn.set_layout(tables, seq, pos)
    kv = rng.standard_normal((4 * CONTEXT, KVH, D)).astype(np.float32)
    attn(0, rng.standard_normal((4 * CONTEXT, H, D)).astype(np.float32), kv, kv * 0.5)
    return attn, tables


def decode(attn, tables, seqs, q, k, v):
    attn.set_layout(tables[seqs], np.arange(len(seqs), dtype=np.int32), np.full(len(seqs), CONTEXT, np.int32))
    return attn(0, q, k, v).copy()


@pytest.mark.parametrize("window", [0, 300])
def test_long_contexts_match_the_reference(window):
    rng = np.random.default_rng(1)
    attn, tables = filled("float32", 2, window)
    q, k, v = (rng.standard_normal((4, h, D)).astype(np.float32) for h in (H, KVH, KVH))
    for seqs in ([0], [0, 1, 2, 3]):  # one sequence: chunks are tasks; four: each item does its chunks
        got = decode(attn, tables, seqs, q[: len(seqs)], k[: len(seqs)], v[: len(seqs)])
        kc, vc = attn.dequantized(0)
        want = reference_attention(q[: len(seqs)], k[: len(seqs)], v[: len(seqs)], kc, vc, tables[seqs],
                                   np.arange(len(seqs)), np.full(len(seqs), CONTEXT), window=window, write=False)
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("dtype", list(KV_DTYPES))
def test_a_tokens_bits_do_not_depend_on_its_company(dtype):
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((4, h, D)).astype(np.float32) for h in (H, KVH, KVH))
    alone = []
    for s in range(4):  # each sequence alone, 2 threads: its 3 chunks x 2 kv heads are the tasks
        attn, tables = filled(dtype, 2)
        alone.append(decode(attn, tables, [s], q[s : s + 1], k[s : s + 1], v[s : s + 1])[0])
    attn, tables = filled(dtype, 1)  # all four, 1 thread: each (token, kv head) item does its chunks in turn
    together = decode(attn, tables, [0, 1, 2, 3], q, k, v)
    np.testing.assert_array_equal(together, np.stack(alone))


def test_a_long_request_gets_the_same_tokens_alone_and_in_a_batch():
    model = tiny_llama(hidden=64, heads=4, kv_heads=2, layers=2, ctx=1024)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompt = [(7 * j) % 90 + 1 for j in range(600)]  # past two chunks
    others = [[(3 * j + i) % 90 + 1 for j in range(20 + 40 * i)] for i in range(4)]
    alone = LLMEngine(model, EngineConfig(num_kv_blocks=256, num_threads=2)).generate([prompt], params)
    engine = LLMEngine(model, EngineConfig(num_kv_blocks=256, num_threads=2, max_num_batched_tokens=96))
    together = engine.generate([*others[:2], prompt, *others[2:]], params)
    assert together[2].token_ids == alone[0].token_ids
