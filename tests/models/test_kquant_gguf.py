"""Llama GGUF files in llama.cpp's Q4_K_M mix and in every other type we read since (Q5_0, Q5_1,
Q2_K..Q6_K, IQ4_NL, IQ4_XS), written by scripts/make_random_gguf.py with random but valid blocks.

transformers reads the same files (it dequantizes with the gguf package): the weights are equal,
the logits close and the greedy ids equal. Our quantized model (Q4_K and Q6_K in panels of their
own, the other 32-wide types in 8-bit panels, Q3_K / Q2_K dequantized at load) gives our float32
model's logits bit for bit.
"""

import importlib.util
import logging
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from scratchllm import FormatError  # noqa: E402
from scratchllm.engine.paged_attention import PagedSequence  # noqa: E402
from scratchllm.formats import ggml_quants as gq  # noqa: E402
from scratchllm.models import ContiguousKVCache, load_model  # noqa: E402
from scratchllm.models.llama_params import QuantizedRows  # noqa: E402
from scratchllm.models.packed import PackedWeight  # noqa: E402
from tests.gguf_reference import gguf_model  # noqa: E402

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "make_random_gguf.py"
VOCAB = 320
MIXES = ("q4_k_m", "every")
PROMPT = [1, 17, 300, 42, 7, 99, 5]
TOL = 1e-4


def _script():
    spec = importlib.util.spec_from_file_location("make_random_gguf", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    script, folder = _script(), tmp_path_factory.mktemp("kquants")
    return {mix: script.write_random_llama_gguf(folder / f"{mix}.gguf", **script.SIZES["small"], vocab=VOCAB,
                                                quant_mix=mix, seed=i) for i, mix in enumerate(MIXES)}


_REFERENCES: dict = {}


def reference(path: Path):
    """transformers' LlamaForCausalLM with the file's weights, dequantized by the gguf package (the
    config from the file, and load_gguf_checkpoint, the reader from_pretrained(gguf_file=) calls:
    from_pretrained itself insists on the `accelerate` package)."""
    if path not in _REFERENCES:
        _REFERENCES[path] = gguf_model(path)
    return _REFERENCES[path]


def _hf_greedy(model, ids, n):
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, min_new_tokens=n)
    return out[0, len(ids):].tolist()


def _our_greedy(model, ids, n, cache):
    logits = model.forward(np.array(ids), np.arange(len(ids)), cache, logits_rows=[len(ids) - 1])
    out = []
    for _ in range(n):
        out.append(int(logits[-1].argmax()))
        logits = model.forward(np.array(out[-1:]), np.array([len(ids) + len(out) - 1]), cache)
    return out


def test_the_q4_k_m_mix_is_llama_cpps(files):
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(files["q4_k_m"])).tensors}
    assert types["output.weight"] == "Q6_K" and types["token_embd.weight"] == "Q4_K"
    # 4 layers: llama.cpp's use_more_bits picks layers 2 ((i - 0) % 3 == 2) and 3 (the last eighth)
    for i in range(4):
        more = "Q6_K" if i in (2, 3) else "Q4_K"
        assert types[f"blk.{i}.attn_v.weight"] == types[f"blk.{i}.ffn_down.weight"] == more
        assert {types[f"blk.{i}.{n}.weight"] for n in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up")} \
            == {"Q4_K"}
    every = {t.tensor_type.name for t in gguf.GGUFReader(str(files["every"])).tensors}
    assert every >= {"Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS"}


@pytest.mark.parametrize("mix", MIXES)
def test_weights_equal_transformers_dequantized(files, mix):
    ref = reference(files[mix]).state_dict()
    ours = load_model(files[mix], dtype="float32")
    names = [n for n in ref if n != "lm_head.weight" or not ours.config.tie_word_embeddings]
    assert set(names) == set(ours.weights)
    for name in names:  # q/k rows unpermuted, every type dequantized as the gguf package does
        np.testing.assert_array_equal(ours.weights[name], ref[name].numpy(), err_msg=name)


@pytest.mark.parametrize("mix", MIXES)
def test_logits_and_greedy_ids_equal_transformers(files, mix):
    ref, ours = reference(files[mix]), load_model(files[mix], dtype="float32")
    with torch.no_grad():
        want = ref(torch.tensor([PROMPT])).logits[0].numpy()
    got = ours.forward(np.array(PROMPT), np.arange(len(PROMPT)), ContiguousKVCache.for_model(ours.config, 8))
    assert np.abs(got - want).max() <= TOL * np.abs(want).max(), np.abs(got - want).max()
    assert np.array_equal(got.argmax(-1), want.argmax(-1))
    # (random weights settle on one token within a few steps: the logits above are the finer check)
    assert _our_greedy(ours, PROMPT, 8, ContiguousKVCache.for_model(ours.config, 16)) == _hf_greedy(ref, PROMPT, 8)


@pytest.mark.parametrize("mix", MIXES)
def test_quantized_model_gives_the_float32_logits_bit_for_bit(files, mix, caplog):
    with caplog.at_level(logging.INFO, logger="scratchllm.models.loader"):
        q = load_model(files[mix], dtype="quantized")  # the exact path
    f32 = load_model(files[mix], dtype="float32")
    assert q.dtype == "quantized"
    line = [r.getMessage() for r in caplog.records if "dequantized to float32" in r.getMessage()]
    assert len(line) == (mix == "every"), line  # Q2_K, Q3_K and what is fused with them: float32
    if mix == "q4_k_m":
        # every matrix stays quantized: layers 0 and 1 are all Q4_K, in K-quant panels; layer 2's
        # q|k|v holds a Q6_K part beside Q4_K ones: each run in its own panels; the LM head is Q6_K
        for i in range(4):
            assert {p.dtype for p in q.params.layers[i].matrices().values()} == {"quantized"}
        for i in (0, 1):
            assert q.params.layers[i].qkv.panels.kind == "Q4_K"
        qkv = q.params.layers[2].qkv.panels
        assert [p.kind for p in qkv.parts] == ["Q4_K", "Q6_K"] and qkv.cols == (256 + 128, 128)
        assert q.params.lm_head.panels.kind == "Q6_K"
        table = q.params.embed_tokens  # the untied Q4_K table: its blocks, dequantized a row at a time
        assert isinstance(table, QuantizedRows) and table.kind == "Q4_K"
        assert table.nbytes == table.shape[0] * table.shape[1] // 256 * 144
    ids, pos = np.array(PROMPT), np.arange(len(PROMPT))
    got = q.forward(ids, pos, ContiguousKVCache.for_model(q.config, 8))  # the Python loop over the kernels
    np.testing.assert_array_equal(got, f32.forward(ids, pos, ContiguousKVCache.for_model(f32.config, 8)))
    assert q.params.blocks is not None  # every block in one C call, with the paged attention
    paged = _our_greedy(q, PROMPT, 8, PagedSequence(q.config, 16))
    assert paged == _our_greedy(f32, PROMPT, 8, PagedSequence(f32.config, 16))
    got = q.forward(ids, pos, PagedSequence(q.config, 8))
    np.testing.assert_array_equal(got, f32.forward(ids, pos, PagedSequence(f32.config, 8)))


def _random_raw(kind, rows, cols, seed):
    """Random blocks with any finite float16 scales (tests/formats/test_ggml_kquants.py's kind)."""
    rng = np.random.default_rng(seed)
    block = gq.BLOCK_DTYPES[kind]
    raw = rng.integers(0, 256, rows * cols // gq.BLOCK_SIZE[kind] * block.itemsize, dtype=np.uint8)
    for field in ("d", "dmin", "m"):
        if field in block.names:
            h = raw.view(block)[field].view(np.uint16)
            h[(h & 0x7C00) == 0x7C00] &= 0x83FF  # no inf / NaN
            h[:] = (h & 0x8000) | np.minimum(h & 0x7FFF, 0x2C00)  # |scale| <= 1/16: products stay finite
    return raw


@pytest.mark.parametrize("kinds", [("Q4_K",), ("Q5_K",), ("Q5_0",), ("Q5_1",), ("IQ4_NL",), ("IQ4_XS",),
                                   ("Q4_K", "Q5_0", "Q4_1"), ("IQ4_XS", "Q8_0", "Q5_K")])
@pytest.mark.parametrize("M", [1, 3, 16])
def test_packed_products_equal_the_float32_products_of_the_dequantized_matrix(kinds, M):
    """The kernels' d * q + m per 32 (8-bit panels, float32 d and m) against the float32 kernel on
    gguf-py's dequantized matrix, bit for bit: every part of a fused matrix as the loader fuses it."""
    K, rows = 512, [40, 24, 8][: len(kinds)]
    parts, dense = [], []
    for i, (kind, n) in enumerate(zip(kinds, rows, strict=True)):
        raw = _random_raw(kind, n, K, seed=10 * M + i)
        if kind in ("Q4_0", "Q4_1"):
            parts.append(gq.as_q4(kind, raw, (n, K)))
        else:
            parts.append(gq.as_q8(kind, raw, (n, K)))
        dense.append(gguf.quants.dequantize(raw.reshape(n, -1), gguf.GGMLQuantizationType[kind]).astype(np.float32))
    packed = PackedWeight.from_quantized_rows(parts)
    assert packed.dtype == "quantized" and packed.panels.q.dtype == np.uint8 and packed.shape == (K, sum(rows))
    want = PackedWeight.from_rows(dense)
    np.testing.assert_array_equal(packed.numpy() + 0.0, want.numpy() + 0.0)  # + 0.0: m = +0 turns -0 into +0
    x = np.random.default_rng(M).standard_normal((M, K)).astype(np.float32)
    np.testing.assert_array_equal(x @ packed, x @ want)
    out = np.empty((M, sum(rows)), np.float32)
    np.testing.assert_array_equal(packed.matmul_into(x, out), x @ want)


def test_a_type_we_do_not_read_is_refused_at_load(tmp_path):
    path = tmp_path / "iq2.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("blk.0.attn_q.weight", np.zeros((4, 66), np.uint8), raw_dtype=gguf.GGMLQuantizationType.IQ2_XXS)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(FormatError, match=r"tensor 'blk.0.attn_q.weight' is IQ2_XXS, a GGML type we do not read; "
                                          r"supported: .*Q4_K.*Q6_K") as err:
        load_model(path)
    assert err.value.path == str(path)
