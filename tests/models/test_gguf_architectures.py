"""Every architecture in every quantization type, from GGUF files the test writes with the gguf
package: Llama 3 (its rope scaling as rope_freqs.weight), Mistral (a sliding window on every
layer), Qwen3 (QK-norm), Phi-3 (fused attn_qkv and gate|up), Gemma 2 (soft-capping, alternate
windows) and Gemma 3 (two rope bases, windowed layers and a global one).

One small file per architecture holds all twelve types: each layer's four matrix groups (q|k|v,
o, gate|up, down) take the next four types of the cycle, so three layers meet all of them, each
fused group of one type (so the quantized kernels keep every type they can), and the cycle
starts elsewhere for each architecture, so a type meets other roles in other files.
The embedding and the untied LM head take types of the cycle too. The 32-wide types are
quantized from Gaussian weights by the gguf package; the K-quants and IQ4 types are random
valid blocks (scripts/make_random_gguf.py).

Against references nobody here wrote: every tensor we read equals gguf-py's `dequantize` bit for
bit; transformers (which loads the same file, dequantizing with gguf-py) has the same weights,
logits within 1e-4 of the largest and the same greedy ids. And our quantized model (the file's
blocks kept in the kernels' panels, the C blocks on the engine's paged attention) gives our
float32 model's logits bit for bit.
"""

import math
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from scratchllm.engine.paged_attention import PagedSequence  # noqa: E402
from scratchllm.formats import load_checkpoint  # noqa: E402
from scratchllm.models import ContiguousKVCache, load_model  # noqa: E402
from tests.gguf_reference import file_config, gguf_model  # noqa: E402
from tests.models.test_kquant_gguf import _our_greedy, _script  # noqa: E402

TYPES = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1", "IQ4_NL", "IQ4_XS", "Q4_0", "Q4_1", "Q8_0")
QUANTIZED_BY_GGUF = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")  # gguf.quants.quantize writes these
VOCAB, HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM = 320, 256, 256, 4, 2, 64  # rows of whole 256-blocks
# Llama 3.1's rope scaling, on a short original context so that all three bands are used
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
ARCHS = {  # name: (general.architecture, layers, tied embeddings, what else the file says)
    "llama3": ("llama", 3, False, {}),
    "mistral": ("llama", 3, True, {"sliding_window": 7}),
    "qwen3": ("qwen3", 3, False, {}),
    "phi3": ("phi3", 3, True, {"sliding_window": 9}),
    "gemma2": ("gemma2", 3, True, {"sliding_window": 5, "attn_softcap": 0.5, "final_softcap": 1.0}),
    "gemma3": ("gemma3", 3, True, {"sliding_window": 5, "sliding_window_pattern": 3}),  # the third global
}
PROMPT = [5, 17, 300, 42, 7, 99, 5, 250, 11, 3, 64, 128]  # longer than every window
TOL = 1e-4


def llama3_rope_factors(head_dim, rope):
    """What llama.cpp's converter writes as rope_freqs.weight for Llama 3.1's rope scaling: per
    frequency, the divisor that stretches it (1 for short wavelengths, `factor` for long ones, a
    blend between)."""
    old = rope["original_max_position_embeddings"]
    low, high, factor = rope["low_freq_factor"], rope["high_freq_factor"], rope["factor"]
    out = []
    for freq in rope["rope_theta"] ** -(np.arange(0, head_dim, 2) / head_dim):
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _add_hyperparameters(w, name, arch, layers, extra):
    """The key-value metadata of a random `name` model (the sizes above, its family's extras)."""
    w.add_name(name)  # transformers reads a llama file named exactly "mistral" as Mistral
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(layers)
    w.add_feed_forward_length(INTER)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(VOCAB)
    w.add_rope_freq_base(LLAMA3_ROPE["rope_theta"] if name == "llama3" else 1e6 if name == "gemma3" else 10000.0)
    if arch == "llama":
        w.add_rope_dimension_count(HEAD_DIM)
    if name == "gemma3":
        w.add_rope_freq_base_swa(10000.0)
    if "sliding_window" in extra:
        w.add_sliding_window(extra["sliding_window"])
    if "sliding_window_pattern" in extra:
        w.add_sliding_window_pattern(extra["sliding_window_pattern"])
    if name == "gemma2":
        w.add_attn_logit_softcapping(extra["attn_softcap"])
        w.add_final_logit_softcapping(extra["final_softcap"])


def write_gguf(path, name, seed):
    """A random `name` model in every type of TYPES (see the module docstring); returns path."""
    arch, layers, tied, extra = ARCHS[name]
    script, rng = _script(), np.random.default_rng(seed)
    shift = 5 * seed  # where this file's type cycle starts
    w = gguf.GGUFWriter(str(path), arch)
    _add_hyperparameters(w, name, arch, layers, extra)

    def matrix(tensor, rows, cols, kind):
        qtype = gguf.GGMLQuantizationType[kind]
        if kind in QUANTIZED_BY_GGUF:
            data = gguf.quants.quantize(rng.standard_normal((rows, cols), dtype=np.float32) * 0.05, qtype)
        else:
            data = script.random_blocks(kind, rows, cols, rng)
        w.add_tensor(tensor, data, raw_dtype=qtype)

    def norm(tensor, n):  # random scales around 1 (Gemma's files store 1 + w): a swapped norm shows
        w.add_tensor(tensor, rng.uniform(0.6, 1.4, n).astype(np.float32))

    matrix("token_embd.weight", VOCAB, HIDDEN, TYPES[(shift + 7) % len(TYPES)])
    if not tied:
        matrix("output.weight", VOCAB, HIDDEN, TYPES[(shift + 3) % len(TYPES)])
    if name == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_rope_factors(HEAD_DIM, LLAMA3_ROPE))
    norm("output_norm.weight", HIDDEN)
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    for i in range(layers):
        b = f"blk.{i}."
        qkv_type, o_type, gate_up_type, down_type = (TYPES[(shift + 4 * i + g) % len(TYPES)] for g in range(4))
        if arch == "phi3":
            matrix(b + "attn_qkv.weight", q + 2 * kv, HIDDEN, qkv_type)
            matrix(b + "ffn_up.weight", 2 * INTER, HIDDEN, gate_up_type)  # gate | up
        else:
            for t, rows in (("attn_q", q), ("attn_k", kv), ("attn_v", kv)):
                matrix(b + t + ".weight", rows, HIDDEN, qkv_type)
            matrix(b + "ffn_gate.weight", INTER, HIDDEN, gate_up_type)
            matrix(b + "ffn_up.weight", INTER, HIDDEN, gate_up_type)
        matrix(b + "attn_output.weight", HIDDEN, q, o_type)
        matrix(b + "ffn_down.weight", HIDDEN, INTER, down_type)
        norm(b + "attn_norm.weight", HIDDEN)
        norm(b + "ffn_norm.weight", HIDDEN)
        if arch in ("gemma2", "gemma3"):
            norm(b + "post_attention_norm.weight", HIDDEN)
            norm(b + "post_ffw_norm.weight", HIDDEN)
        if arch in ("qwen3", "gemma3"):
            norm(b + "attn_q_norm.weight", HEAD_DIM)
            norm(b + "attn_k_norm.weight", HEAD_DIM)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gguf_archs")
    made = {}

    def get(name):
        if name not in made:
            made[name] = write_gguf(folder / f"{name}.gguf", name, seed=list(ARCHS).index(name))
        return made[name]

    return get


_REFERENCES: dict = {}


def reference(path: Path, name: str):
    """transformers' model of the file: its config from the file (AutoConfig, gguf_file=), the
    file's tensors dequantized by the gguf package (load_gguf_checkpoint, what from_pretrained
    calls; from_pretrained itself wants the accelerate package). transformers' GGUF reader leaves
    some metadata out; those settings are put back as llama.cpp reads the file: the windows of
    Mistral and Phi-3, Gemma 2's soft-caps, Gemma's softmax scale (1 / sqrt(head size)), Gemma 3's
    sliding_window_pattern, Qwen3's
    head size (attention.key_length) and Llama 3's rope scaling (the file's rope_freqs.weight,
    from these parameters)."""
    if path not in _REFERENCES:
        extra = ARCHS[name][3]
        config = file_config(path)
        if name in ("mistral", "phi3"):
            config.sliding_window = extra["sliding_window"]
        if name == "gemma2":
            config.attn_logit_softcapping = extra["attn_softcap"]
            config.final_logit_softcapping = extra["final_softcap"]
        if name in ("gemma2", "gemma3"):
            config.query_pre_attn_scalar = HEAD_DIM
        if name == "gemma3":
            pattern = extra["sliding_window_pattern"]
            config.layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                                  for i in range(config.num_hidden_layers)]
        if name == "qwen3":
            config.head_dim = HEAD_DIM
        if name == "llama3":
            config.rope_parameters = dict(LLAMA3_ROPE)
        config.pad_token_id = config.eos_token_id = None  # the file has no tokenizer (Phi-3's defaults are 32000)
        config._attn_implementation = "eager"
        # transformers finds the file's name for each tensor through gguf-py's table of
        # architectures, which lists no "mistral" (llama.cpp files Mistral under llama): the
        # tensors are read for a Llama of the same shape, whose parameters have the same names
        names = None if name != "mistral" else transformers.LlamaForCausalLM(
            transformers.LlamaConfig(**{k: v for k, v in config.to_dict().items() if k != "model_type"}))
        model = gguf_model(path, config, names)
        assert type(model).__name__.lower().startswith(name.rstrip("3") if name != "gemma3" else name), model
        _REFERENCES[path] = model
    return _REFERENCES[path]


@pytest.mark.parametrize("name", ARCHS)
def test_each_type_reads_as_gguf_py_dequantizes_it(files, name):
    """Every tensor of the file, read by formats/, against gguf-py's dequantize of its blocks."""
    path = files(name)
    ckpt, seen = load_checkpoint(path), set()
    for t in gguf.GGUFReader(str(path)).tensors:
        seen.add(t.tensor_type.name)
        want = gguf.quants.dequantize(t.data, t.tensor_type).reshape(ckpt.tensor_info(t.name).shape)
        np.testing.assert_array_equal(ckpt[t.name], want, err_msg=t.name)
    assert seen >= set(TYPES), set(TYPES) - seen


@pytest.mark.parametrize("name", ARCHS)
def test_weights_logits_and_greedy_ids_equal_transformers(files, name):
    path = files(name)
    ref, ours = reference(path, name), load_model(path, dtype="float32")
    state = ref.state_dict()
    names = [n for n in state if n != "lm_head.weight" or not ours.config.tie_word_embeddings]
    assert set(names) == set(ours.weights) - {"rope_freqs.weight"}
    for n in names:  # q/k rows unpermuted (Llama), Gemma's norms as 1 + w
        want = state[n].numpy() + (1.0 if name.startswith("gemma") and n.endswith("norm.weight") else 0.0)
        np.testing.assert_array_equal(ours.weights[n], want.astype(np.float32), err_msg=n)
    # our prefill and 7 greedy decode steps; transformers' logits on the same 19 tokens in one
    # forward: equal logits at every position, and its greedy pick at each of the 8 steps is ours
    cache, n = ContiguousKVCache.for_model(ours.config, 24), len(PROMPT)
    rows = [ours.forward(np.array(PROMPT), np.arange(n), cache)]
    greedy = [int(rows[0][-1].argmax())]
    for step in range(7):
        rows.append(ours.forward(np.array(greedy[-1:]), np.array([n + step]), cache))
        greedy.append(int(rows[-1][-1].argmax()))
    got = np.concatenate(rows)
    with torch.no_grad():
        want = ref(torch.tensor([PROMPT + greedy[:-1]])).logits[0].numpy()
    assert np.abs(got - want).max() <= TOL * np.abs(want).max(), np.abs(got - want).max() / np.abs(want).max()
    assert want[n - 1:].argmax(-1).tolist() == greedy


@pytest.mark.parametrize("name", ARCHS)
def test_quantized_model_gives_the_float32_logits_bit_for_bit(files, name):
    path = files(name)
    q, f32 = load_model(path, dtype="quantized"), load_model(path, dtype="float32")  # the exact path
    assert q.dtype == "quantized" and q.params.blocks is not None
    kept = {m.dtype for layer in q.params.layers for m in layer.matrices().values()}
    assert kept == {"quantized"}  # every type stays quantized: K-quants in panels of their own, the rest 4- or 8-bit
    ids, pos = np.array(PROMPT), np.arange(len(PROMPT))
    for make in (lambda cfg: ContiguousKVCache.for_model(cfg, 24), lambda cfg: PagedSequence(cfg, 24)):
        np.testing.assert_array_equal(q.forward(ids, pos, make(q.config)), f32.forward(ids, pos, make(f32.config)))
    paged = [_our_greedy(m, PROMPT, 8, PagedSequence(m.config, 24)) for m in (q, f32)]
    assert paged[0] == paged[1]
