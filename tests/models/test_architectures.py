"""The llama family's architectures against Hugging Face transformers: Gemma 3, Gemma 2, Gemma,
Qwen3, Llama 3 (rope scaling), Mistral (sliding window) and Phi-3 (fused checkpoint matrices).

Each tiny random model is built by transformers from its own config class (float32, eager
attention), saved with save_pretrained and loaded by our loader; its logits at every position of
a prompt (prefilled in part, the rest decoded a token at a time through the model's own
ContiguousKVCache) must equal transformers' within 1e-4 of the largest, and greedy decoding must
pick the same tokens. The prompts are longer than the windows, and the scores and logits large
enough for the soft-caps to bend them.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from scratchllm.errors import ConfigError  # noqa: E402
from scratchllm.models import ContiguousKVCache, attention, load_model  # noqa: E402
from scratchllm.models.config import from_gguf_metadata, from_hf_config  # noqa: E402

TOL = 1e-4
VOCAB = 320
SMALL = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, intermediate_size=96,
             max_position_embeddings=128, bos_token_id=1, eos_token_id=2, pad_token_id=0)
SLIDING, FULL = "sliding_attention", "full_attention"


def _gemma3():
    # head_dim 32 != hidden / heads, two rope bases, a query_pre_attn_scalar of its own
    cfg = transformers.Gemma3TextConfig(
        **SMALL, num_hidden_layers=3, num_key_value_heads=2, head_dim=32, sliding_window=6,
        layer_types=[SLIDING, SLIDING, FULL], query_pre_attn_scalar=20,
        rope_parameters={FULL: {"rope_type": "default", "rope_theta": 1e6},
                         SLIDING: {"rope_type": "default", "rope_theta": 10000.0}})
    return transformers.Gemma3ForCausalLM(cfg)


def _gemma2():
    cfg = transformers.Gemma2Config(**SMALL, num_hidden_layers=3, num_key_value_heads=1, head_dim=16,
                                    sliding_window=5, attn_logit_softcapping=3.0, final_logit_softcapping=4.0,
                                    query_pre_attn_scalar=12)
    return transformers.Gemma2ForCausalLM(cfg)


def _gemma():  # Gemma (1): Gemma's norms, GeGLU and scaled tied embeddings, in Llama's blocks
    cfg = transformers.GemmaConfig(**SMALL, num_hidden_layers=2, num_key_value_heads=1, head_dim=32)
    return transformers.GemmaForCausalLM(cfg)


def _qwen3():
    cfg = transformers.Qwen3Config(**SMALL, num_hidden_layers=2, num_key_value_heads=2, head_dim=32,
                                   tie_word_embeddings=False)
    return transformers.Qwen3ForCausalLM(cfg)


def _llama3():
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
    cfg = transformers.LlamaConfig(**SMALL, num_hidden_layers=2, num_key_value_heads=2, rope_parameters=rope)
    return transformers.LlamaForCausalLM(cfg)


def _llama_linear():
    rope = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}
    cfg = transformers.LlamaConfig(**SMALL, num_hidden_layers=2, num_key_value_heads=4, rope_parameters=rope)
    return transformers.LlamaForCausalLM(cfg)


def _mistral():
    cfg = transformers.MistralConfig(**SMALL, num_hidden_layers=2, num_key_value_heads=2, sliding_window=7)
    return transformers.MistralForCausalLM(cfg)


def _phi3():
    cfg = transformers.Phi3Config(**SMALL, num_hidden_layers=2, num_key_value_heads=2, sliding_window=9)
    return transformers.Phi3ForCausalLM(cfg)


BUILDERS = {"gemma3": _gemma3, "gemma2": _gemma2, "gemma": _gemma, "qwen3": _qwen3, "llama3": _llama3,
            "llama-linear-rope": _llama_linear, "mistral": _mistral, "phi3": _phi3}


def _randomize(model):
    # Fresh norms are all 1 (Gemma: all 0) and biases 0, which would hide a missing or swapped
    # norm; random values make every tensor matter.
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2 + (1.0 if p.ndim == 1 and p.abs().sum() > 0 else 0.0))
    return model.eval()


_SAVED: dict = {}


def _saved(arch, tmp_path_factory):
    """(reference model, folder), built once per module run."""
    if arch not in _SAVED:
        torch.manual_seed(0)
        ref = _randomize(BUILDERS[arch]())
        ref.config._attn_implementation = "eager"
        folder = tmp_path_factory.mktemp(arch)
        ref.save_pretrained(folder)
        _SAVED[arch] = ref, folder
    return _SAVED[arch]


def _ref_logits(ref, ids):
    with torch.no_grad():
        return ref(torch.tensor(ids)[None]).logits[0].numpy()


def _our_logits(model, ids, prefill):
    """Logits at every position: the first `prefill` ids in one step, the rest one at a time."""
    cache = ContiguousKVCache.for_model(model.config, len(ids))
    rows = [model.forward(np.asarray(ids[:prefill]), np.arange(prefill), cache)]
    for p in range(prefill, len(ids)):
        rows.append(model.forward(np.asarray(ids[p : p + 1]), np.array([p]), cache))
    return np.concatenate(rows)


def _assert_close(got, want):
    scale = np.abs(want).max()
    np.testing.assert_allclose(got, want, rtol=0, atol=TOL * scale)


@pytest.mark.parametrize("arch", sorted(BUILDERS))
def test_logits_equal_transformers(arch, tmp_path_factory):
    ref, folder = _saved(arch, tmp_path_factory)
    model = load_model(str(folder))
    ids = np.random.default_rng(0).integers(3, VOCAB, 24)  # longer than every window
    _assert_close(_our_logits(model, ids, prefill=11), _ref_logits(ref, ids))


@pytest.mark.parametrize("arch", ["gemma3", "gemma2", "mistral"])
def test_windowed_prefill_in_query_blocks(arch, tmp_path_factory, monkeypatch):
    """A prefill longer than attention.QUERY_BLOCK goes in blocks of queries, each against only the
    keys its window lets it see."""
    monkeypatch.setattr(attention, "QUERY_BLOCK", 4)
    ref, folder = _saved(arch, tmp_path_factory)
    model = load_model(str(folder))
    ids = np.random.default_rng(1).integers(3, VOCAB, 21)
    _assert_close(_our_logits(model, ids, prefill=19), _ref_logits(ref, ids))


@pytest.mark.parametrize("arch", sorted(BUILDERS))
def test_greedy_ids_equal_transformers(arch, tmp_path_factory):
    ref, folder = _saved(arch, tmp_path_factory)
    model = load_model(str(folder))
    prompt = [int(i) for i in np.random.default_rng(2).integers(3, VOCAB, 5)]
    n = 12  # the context grows past the windows while decoding
    with torch.no_grad():
        want = ref.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n,
                            pad_token_id=0)[0, len(prompt):].tolist()
    cache = ContiguousKVCache.for_model(model.config, len(prompt) + n)
    logits = model.forward(np.array(prompt), np.arange(len(prompt)), cache)
    got = []
    for step in range(n):
        logits[-1, 2] = -np.inf  # min_new_tokens: transformers masks the eos token the same way
        got.append(int(logits[-1].argmax()))
        logits = model.forward(np.array(got[-1:]), np.array([len(prompt) + step]), cache)
    assert got == want


def test_config_pieces(tmp_path_factory):
    """What each checkpoint's config turns into: the attention contract and the named pieces."""
    read = {arch: load_model(str(_saved(arch, tmp_path_factory)[1])).config for arch in ("gemma3", "gemma2", "phi3")}
    g3, g2, phi3 = read["gemma3"], read["gemma2"], read["phi3"]
    assert g3.layer_windows == (6, 6, 0) and g3.rope_base(0) == 10000.0 and g3.rope_base(2) == 1e6
    assert g3.softmax_scale == 20 ** -0.5 and g3.arch.qk_norm and g3.arch.sandwich_norms and g3.embed_scale == 8.0
    assert g2.layer_windows == (5, 0, 5) and g2.attn_softcap == 3.0 and g2.final_softcap == 4.0
    assert phi3.layer_windows == (9, 9) and phi3.arch.fused_projections


@pytest.mark.parametrize("change,message", [
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope scaling 'yarn' is not supported"),
    ({"rope_scaling": {"type": "longrope", "factor": 4.0}}, "rope scaling 'longrope' is not supported"),
    ({"hidden_act": "gelu"}, "activation 'gelu' is not supported"),
    ({"partial_rotary_factor": 0.5}, "partial rotary"),
    ({"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "text_config": {}},
     r"unsupported architecture \['Gemma3ForConditionalGeneration'\]: we run .*Gemma3ForCausalLM"),
])
def test_unsupported_options_are_named(change, message):
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 10, "hidden_size": 8,
           "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 8} | change
    with pytest.raises(ConfigError, match=message):
        from_hf_config(cfg)


def test_unsupported_gguf_architecture_lists_the_supported():
    with pytest.raises(ConfigError, match=r"'falcon' is not supported \(llama, qwen2, qwen3, phi3, gemma2, gemma3\)"):
        from_gguf_metadata({"general.architecture": "falcon"}, True, False)
    meta = {"general.architecture": "llama", "llama.embedding_length": 8, "llama.attention.head_count": 2,
            "llama.block_count": 1, "llama.feed_forward_length": 8, "llama.context_length": 16,
            "llama.attention.layer_norm_rms_epsilon": 1e-5, "llama.vocab_size": 10, "llama.rope.scaling.type": "yarn"}
    with pytest.raises(ConfigError, match="rope scaling 'yarn' is not supported"):
        from_gguf_metadata(meta, True, False)


def _gguf_meta(arch, **keys):
    base = {"embedding_length": 64, "attention.head_count": 4, "block_count": 4, "feed_forward_length": 8,
            "context_length": 16, "attention.layer_norm_rms_epsilon": 1e-6, "vocab_size": 10} | keys
    return {"general.architecture": arch} | {f"{arch}.{k}": v for k, v in base.items()}


def test_gguf_windows_and_gemma_scales():
    """A llama file that states a window (Mistral) windows every layer; Gemma 3's pattern may be
    a count or a flag per layer; the Gemma 27B models take llama.cpp's scale 1 / sqrt(hidden / heads)."""
    assert from_gguf_metadata(_gguf_meta("llama", **{"attention.sliding_window": 7}), True, False).layer_windows \
        == (7, 7, 7, 7)
    with pytest.raises(ConfigError, match="qwen2: sliding-window attention is not supported"):
        from_gguf_metadata(_gguf_meta("qwen2", **{"attention.sliding_window": 7}), True, False)
    flags = {"attention.sliding_window": 5, "attention.sliding_window_pattern": [True, False, True, True]}
    assert from_gguf_metadata(_gguf_meta("gemma3", **flags), True, False).layer_windows == (5, 0, 5, 5)
    with pytest.raises(ConfigError, match="3 entries for 4 layers"):
        from_gguf_metadata(_gguf_meta("gemma3", **flags | {"attention.sliding_window_pattern": [True] * 3}),
                           True, False)
    assert from_gguf_metadata(_gguf_meta("gemma3", **{"attention.sliding_window_pattern": 2,
                                                      "attention.sliding_window": 3}), True, False).layer_windows \
        == (3, 0, 3, 0)
    head = {"attention.key_length": 32, "attention.value_length": 32}
    assert from_gguf_metadata(_gguf_meta("gemma2", **head), True, False).softmax_scale == 32 ** -0.5
    big = from_gguf_metadata(_gguf_meta("gemma2", **head | {"block_count": 46}), True, False)
    assert big.softmax_scale == (64 / 4) ** -0.5  # hidden / heads = 16, not the head size 32
