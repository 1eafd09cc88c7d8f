"""The KV-cache dtype: the kernel reads float16, bfloat16 and int8 pools in place and gives what
the NumPy reference gives on the same (dequantized) values; each dtype is written as documented
(float16 and bfloat16 rounded to nearest even, int8 with a scale per block and kv head); a
quantized model's logits equal its dequantized float32 model's bit for bit at each dtype; and a
request's tokens are the same alone and in a batch."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from scratchllm.engine import EngineConfig, LLMEngine
from scratchllm.engine.kv_sizing import KV_DTYPES, kv_bytes_per_token, resolve_kv_dtype
from scratchllm.engine.memory_plan import plan_memory
from scratchllm.engine.paged_attention import PagedAttention, PagedSequence, reference_attention
from scratchllm.errors import ConfigError
from scratchllm.sampling import SamplingParams

from .test_paged_attention import layout
from .tiny import tiny_llama

DTYPES = list(KV_DTYPES)


def bf16_bits(x):
    """float32 -> bfloat16 bits, rounded to nearest even (what torch's .to(bfloat16) does)."""
    bits = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def two_steps(dtype, H, KVH, D, BS, threads=1, seed=0):
    """A step that fills the sequences' prefixes, then a step of prefill chunks and decodes over
    them: (attention, the second step's q, k, v, layout, output)."""
    rng = np.random.default_rng(seed)
    NB = 64
    seqs = [(0, 7), (5, 1), (9, 6), (0, 1), (13, 1), (3, 9), (20, 1)]
    tables, tseq, tpos = layout(rng, seqs, BS, NB)
    attn = PagedAttention(1, NB, BS, KVH, D, num_threads=threads, kv_dtype=dtype)
    prefix = [(s, p) for s, (c, _) in enumerate(seqs) for p in range(c)]
    if prefix:
        pseq, ppos = (np.array(a, np.int32) for a in zip(*prefix, strict=True))
        n = len(pseq)
        attn.set_layout(tables, pseq, ppos)
        attn(0, *(rng.standard_normal((n, h, D)).astype(np.float32) * 2 for h in (H, KVH, KVH)))
    N = len(tseq)
    q, k, v = (rng.standard_normal((N, h, D)).astype(np.float32) * 2 for h in (H, KVH, KVH))
    attn.set_layout(tables, tseq, tpos)
    return attn, (q, k, v), (tables, tseq, tpos), attn(0, q, k, v)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H,KVH,D,BS", [(6, 2, 16, 16), (4, 4, 24, 4), (9, 3, 64, 16)])
def test_kernel_reads_each_dtype_in_place(dtype, H, KVH, D, BS):
    # (24, 4): the plain loops of other head and block sizes; the others the vector ones
    attn, (q, k, v), (tables, tseq, tpos), got = two_steps(dtype, H, KVH, D, BS, threads=2)
    assert attn.k_cache.dtype == KV_DTYPES[dtype] and attn.v_cache.dtype == KV_DTYPES[dtype]
    kc, vc = attn.dequantized(0)  # the values the pool holds, as float32
    want = reference_attention(q, k, v, kc, vc, tables, tseq, tpos, write=False)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    # and what it holds is k and v to within the dtype's rounding
    blocks, slots = tables[tseq, tpos // BS], tpos % BS
    err = {"float32": 0, "float16": 2**-10, "bfloat16": 2**-7, "int8": 2 / 127}[dtype]
    for held, x in ((kc[blocks, :, :, slots], k), (vc[blocks, slots], v)):
        scale = np.abs(x).max() if dtype == "int8" else np.abs(x)
        assert np.all(np.abs(held - x) <= err * scale + 1e-30)


def test_float16_and_bfloat16_are_rounded_to_nearest_even():
    rng = np.random.default_rng(3)
    x = np.concatenate([rng.standard_normal(4000).astype(np.float32) * 10.0 ** rng.integers(-6, 5, 4000),
                        np.float32([0.0, -0.0, 65504.0, 65519.0, 65520.0, 1e-8, 3e-8, 6e-5, -2.9802322e-08])])
    x = x[: len(x) // 16 * 16].astype(np.float32)
    want = {"float16": x.astype(np.float16).view(np.uint16), "bfloat16": bf16_bits(x)}
    for dtype, bits in want.items():
        attn = PagedAttention(1, 1, len(x), 1, 1, kv_dtype=dtype)  # one block of len(x) slots, D = 1
        attn.set_layout(np.zeros((1, 1), np.int32), np.zeros(len(x), np.int32), np.arange(len(x), dtype=np.int32))
        col = x.reshape(-1, 1, 1)
        attn(0, col, col, col)
        np.testing.assert_array_equal(attn.k_cache.reshape(-1).view(np.uint16), bits, err_msg=dtype)
        np.testing.assert_array_equal(attn.v_cache.reshape(-1).view(np.uint16), bits, err_msg=dtype)


def test_int8_keeps_a_scale_per_block_and_kv_head():
    # one sequence, decoded a token at a time: a block's scale is max |x| / 127 over its slots so far,
    # per kv head, and the slots before a larger one are requantized to it
    KVH, D, BS = 2, 16, 16
    rng = np.random.default_rng(4)
    attn = PagedAttention(1, 4, BS, KVH, D, kv_dtype="int8")
    x = (rng.standard_normal((40, KVH, D)) * np.linspace(0.1, 3, 40)[:, None, None]).astype(np.float32)
    x[:, 1] *= 10  # the second kv head ten times the first: its own scales
    table = np.array([[2, 0, 3]], np.int32)
    for p in range(40):
        attn.set_layout(table, np.zeros(1, np.int32), np.array([p], np.int32))
        attn(0, x[p : p + 1].repeat(1, axis=1), x[p : p + 1], x[p : p + 1])
    for b, blk in enumerate(table[0]):
        span = x[b * BS : (b + 1) * BS]  # [t, KVH, D]
        np.testing.assert_allclose(attn.k_scale[0, blk], np.abs(span).max(axis=(0, 2)) / 127, rtol=1e-6)
        np.testing.assert_allclose(attn.v_scale[0, blk], np.abs(span).max(axis=(0, 2)) / 127, rtol=1e-6)
    kc, vc = attn.dequantized(0)
    for p in range(40):
        blk, s = table[0, p // BS], p % BS
        step = attn.k_scale[0, blk][:, None]
        assert np.all(np.abs(kc[blk, :, :, s] - x[p]) <= 2 * step)  # rounding, plus one requantization
        assert np.all(np.abs(vc[blk, s] - x[p]) <= 2 * step)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_block_holds_the_same_bits_however_its_tokens_were_stepped(dtype):
    # the same 21 tokens in one prefill, in chunks, or one at a time: equal pools (so a request's
    # K/V, and its logits, do not depend on the batch or the chunking it ran in)
    KVH, D, BS = 2, 16, 16
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((21, KVH, D)) * np.linspace(0.1, 4, 21)[:, None, None]).astype(np.float32)
    q = rng.standard_normal((21, 4, D)).astype(np.float32)
    pools = []
    for cuts in ([21], [5, 16], [1] * 21):
        attn = PagedAttention(1, 2, BS, KVH, D, kv_dtype=dtype)
        start = 0
        for n in cuts:
            pos = np.arange(start, start + n, dtype=np.int32)
            attn.set_layout(np.array([[1, 0]], np.int32), np.zeros(n, np.int32), pos)
            attn(0, q[pos], x[pos], x[pos])
            start += n
        pools.append([a.copy() for a in attn.arrays()])
    for other in pools[1:]:
        for a, b in zip(pools[0], other, strict=True):
            np.testing.assert_array_equal(a, b)


def test_copy_on_write_copies_an_int8_blocks_scales():
    KVH, D, BS = 2, 16, 16
    attn = PagedAttention(2, 4, BS, KVH, D, kv_dtype="int8")
    rng = np.random.default_rng(6)
    x = rng.standard_normal((5, KVH, D)).astype(np.float32)
    attn.set_layout(np.array([[1]], np.int32), np.zeros(5, np.int32), np.arange(5, dtype=np.int32))
    for layer in range(2):
        attn(layer, x.repeat(2, axis=1)[:, :4], x * (layer + 1), x)
    attn.copy_blocks([(1, 3)])
    for a in attn.arrays():
        np.testing.assert_array_equal(a[:, 3], a[:, 1])
    assert attn.k_scale[1, 3, 0] > 0


def test_bytes_per_token_and_the_memory_plan():
    model = tiny_llama(hidden=64, heads=4, kv_heads=2, layers=3)
    cfg = model.config
    f32 = 2 * 3 * 2 * 16 * 4  # K and V x layers x kv heads x head size x 4 bytes
    assert kv_bytes_per_token(cfg, "float32") == f32
    assert kv_bytes_per_token(cfg, "float16") == kv_bytes_per_token(cfg, "bfloat16") == f32 / 2
    assert kv_bytes_per_token(cfg, "int8") == f32 / 4 + 2 * 3 * 2 * 4 / 16  # + a scale per block, head, K and V
    for dtype in DTYPES:
        plan = plan_memory(model, EngineConfig(kv_cache_memory_bytes=1 << 20, kv_cache_dtype=dtype), 512)
        assert plan.kv_dtype == dtype and plan.kv_bytes_per_token == kv_bytes_per_token(cfg, dtype)
        assert plan.kv_block_bytes == 16 * kv_bytes_per_token(cfg, dtype)
        assert plan.num_kv_blocks == (1 << 20) // plan.kv_block_bytes
        assert f"{dtype}, " in plan.describe()
    assert plan_memory(model, EngineConfig(), 512).kv_dtype == resolve_kv_dtype("auto")
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="fp8")


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_request_gets_the_same_tokens_alone_and_in_a_batch(dtype):
    model = tiny_llama(hidden=64, heads=4, kv_heads=2, layers=2)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompt = [(7 * j) % 90 + 1 for j in range(37)]
    others = [[(3 * j + i) % 90 + 1 for j in range(5 + 9 * i)] for i in range(5)]
    alone = LLMEngine(model, EngineConfig(kv_cache_dtype=dtype, num_kv_blocks=64)).generate([prompt], params)
    together = LLMEngine(model, EngineConfig(kv_cache_dtype=dtype, num_kv_blocks=64, max_num_batched_tokens=24))
    outs = together.generate([*others[:3], prompt, *others[3:]], params)
    assert outs[3].token_ids == alone[0].token_ids


SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "make_random_gguf.py"


@pytest.fixture(scope="module")
def random_gguf(tmp_path_factory):
    pytest.importorskip("gguf")
    spec = importlib.util.spec_from_file_location("make_random_gguf", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    path = tmp_path_factory.mktemp("kvdtype") / "tiny.gguf"
    return script.write_random_llama_gguf(path, **script.SIZES["tiny"], vocab=96, seed=3)


@pytest.mark.parametrize("dtype", DTYPES)
def test_quantized_model_logits_equal_the_dequantized_float32_models_at_each_kv_dtype(random_gguf, dtype):
    from scratchllm.models import load_model

    q, f32 = load_model(random_gguf, dtype="quantized"), load_model(random_gguf, dtype="float32")
    assert q.dtype == "quantized" and q.params.blocks is not None  # the fused blocks, with the paged attention
    prompt = np.array([1, 17, 30, 42, 7, 9, 5, 60, 2, 11, 8, 13, 21, 34, 55, 89, 3, 14])
    caches = [PagedSequence(m.config, 64, kv_dtype=dtype) for m in (q, f32)]
    got = [m.forward(prompt, np.arange(len(prompt)), c) for m, c in zip((q, f32), caches, strict=True)]
    np.testing.assert_array_equal(got[0], got[1])
    token = int(np.argmax(got[0][-1]))
    for _ in range(6):  # decode steps, each reading the cache the last ones wrote
        got = [m.forward(np.array([token]), np.array([c.length]), c) for m, c in zip((q, f32), caches, strict=True)]
        np.testing.assert_array_equal(got[0], got[1])
        token = int(np.argmax(got[0][-1]))


@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_metrics_report_bytes_per_token_and_the_resident_pool(dtype):
    from prometheus_client.parser import text_string_to_metric_families

    from scratchllm.server.metrics import ServerMetrics

    engine = LLMEngine(tiny_llama(hidden=64, heads=4, kv_heads=2, layers=2),
                       EngineConfig(kv_cache_dtype=dtype, num_kv_blocks=64))
    engine.generate([[1, 2, 3] * 7], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    page = ServerMetrics(engine.stats, model_name="tiny").render().decode()
    got = {(s.name, tuple(sorted(s.labels.items()))): s.value
           for family in text_string_to_metric_families(page) for s in family.samples}
    per_token = got[("scratchllm:kv_cache_bytes_per_token", (("model_name", "tiny"),))]
    assert per_token == kv_bytes_per_token(engine.model.config, dtype)
    resident = got[("scratchllm:kv_cache_resident_bytes", (("model_name", "tiny"),))]
    assert resident == 2 * engine.plan.kv_block_bytes  # 24 slots written: 2 blocks, ever


def test_bench_kv_dtype_on_a_tiny_model(tmp_path):
    import argparse

    from scratchllm.bench import kv_dtype
    from tests.models.test_loader import CONFIG, tiny_llama_tensors, write

    parser = argparse.ArgumentParser()
    kv_dtype.add_arguments(parser)
    folder = write(tmp_path / "tiny", tiny_llama_tensors(), {**CONFIG, "max_position_embeddings": 128})
    r = kv_dtype.run(parser.parse_args(["--model", str(folder), "--rounds", "1", "--short", "4", "--long", "40",
                                        "--new-tokens", "4", "--batch", "2", "--kernel-calls", "2",
                                        "--kernel-shapes", "1x16,2x40"]))
    f = r["figures"]
    assert f["float32"]["max_abs_logit_diff"] == 0 and f["float32"]["greedy_agree_steps"] == 4
    assert f["float16"]["kv_bytes_per_token"] == f["float32"]["kv_bytes_per_token"] / 2
    assert 0 < f["int8"]["peak_kv_mb"] < f["float16"]["peak_kv_mb"] < f["float32"]["peak_kv_mb"]
    assert set(r["kernel_us"]) == {"1x16", "2x40"}
    assert "paged attention alone" in kv_dtype.render(r)


@pytest.mark.parametrize("dtype", ["float16", "int8"])
@pytest.mark.parametrize("arch", ["gemma3", "gemma2"])
def test_the_fused_blocks_read_both_pools_of_each_dtype(arch, dtype):
    # a windowed model's step in one C call equals its layer-by-layer loop at this dtype, the
    # windowed layers' pool (and an int8 pool's scales) included
    from tests.models.test_llama_blocks import forward_both, random_model

    model = random_model(arch, seed=1)
    lens = [5, 1, 37, 2]
    seq = np.repeat(np.arange(4), lens).astype(np.int32)
    pos = np.concatenate([np.arange(n) + (20 if n == 1 else 0) for n in lens])
    ids = np.arange(len(seq)) * 13 % model.config.vocab_size
    tables = np.arange(12, dtype=np.int32).reshape(4, 3)

    def attention():
        a = PagedAttention.for_model(model.config, num_blocks=12, block_size=16, kv_dtype=dtype)
        a.set_layout(tables, seq, pos, tables[::-1, ::-1].copy())
        assert a.num_groups == 2 and (a.scales[1] is not None) == (dtype == "int8")
        return a

    fused, loop = forward_both(model, ids, pos, attention)
    np.testing.assert_array_equal(fused, loop)
