"""Whole-model logits against Hugging Face transformers on small random models (STYLE 6, level 2).

Each reference model is saved as safetensors (save_pretrained) and as pytorch_model.bin, then
loaded by our loader (our parsers, our config reader) and run by our forward pass.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from scratchllm.models import ContiguousKVCache, load_model  # noqa: E402

TOL = 1e-4
SMALL = dict(vocab_size=320, hidden_size=64, num_hidden_layers=2, num_attention_heads=4)


def _llama():
    cfg = transformers.LlamaConfig(**SMALL, intermediate_size=96, num_key_value_heads=2,  # GQA: 2 q heads per kv
                                   tie_word_embeddings=True, max_position_embeddings=128, rope_theta=5000.0)
    return transformers.LlamaForCausalLM(cfg)


def _qwen2():
    cfg = transformers.Qwen2Config(**SMALL, intermediate_size=96, num_key_value_heads=1,  # MQA + q/k/v biases
                                   tie_word_embeddings=False, max_position_embeddings=128)
    return transformers.Qwen2ForCausalLM(cfg)


def _gpt2():
    cfg = transformers.GPT2Config(vocab_size=320, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                  bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


def _bert():
    cfg = transformers.BertConfig(**SMALL, intermediate_size=96, max_position_embeddings=64)
    return transformers.BertModel(cfg)


BUILDERS = {"llama": _llama, "qwen2": _qwen2, "gpt2": _gpt2, "bert": _bert}


def _randomize(model):
    # Fresh-initialized biases and norms are all 0 / 1, which would hide a missing bias or a
    # swapped gain; random values make every tensor matter.
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2 + (1.0 if p.ndim == 1 and p.abs().sum() > 0 else 0.0))
    return model.eval()


_SAVED = {}
FORMATS = ("safetensors", "bin")


def _saved(arch, fmt, tmp_path_factory):
    """(reference model, folder) built once per module run."""
    if (arch, fmt) not in _SAVED:
        torch.manual_seed(0)
        ref = _randomize(BUILDERS[arch]())
        folder = tmp_path_factory.mktemp(f"{arch}-{fmt}")
        ref.save_pretrained(folder)
        if fmt == "bin":
            # transformers 5 only writes safetensors; pytorch_model.bin is what older versions wrote:
            # torch.save of the state dict (a zip holding a pickle and the storages)
            (folder / "model.safetensors").unlink()
            torch.save(ref.state_dict(), folder / "pytorch_model.bin")
        _SAVED[arch, fmt] = ref, folder
    return _SAVED[arch, fmt]


def _cases(archs):
    return pytest.mark.parametrize("arch,fmt", [(a, f) for a in archs for f in FORMATS])


def _ids(n, vocab=320, seed=0):
    return np.random.default_rng(seed).integers(0, vocab, n)


@_cases(["llama", "qwen2", "gpt2", "bert"])
def test_logits_equal_transformers(arch, fmt, tmp_path_factory):
    ref, folder = _saved(arch, fmt, tmp_path_factory)
    model = load_model(folder)
    assert model.format == {"safetensors": "safetensors", "bin": "torch"}[fmt]
    if arch == "bert":
        ids = np.stack([_ids(11, seed=1), _ids(11, seed=2), _ids(11, seed=3)])
        mask = np.ones_like(ids)
        mask[1, 6:] = 0  # padded rows: the pad positions must not leak into the real tokens
        mask[2, 2:] = 0
        with torch.no_grad():
            want = ref(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).last_hidden_state.numpy()
        got = model.encode(ids, mask)
        diff = np.abs(got - want)[mask.astype(bool)]
        assert diff.max() <= TOL, diff.max()
        return
    ids = _ids(23)
    with torch.no_grad():
        want = ref(torch.tensor(ids)[None]).logits[0].numpy()
    got = model.forward(ids, np.arange(len(ids)), ContiguousKVCache.for_model(model.config, 32))
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= TOL, np.abs(got - want).max()


@_cases(["llama", "qwen2", "gpt2"])
def test_incremental_decode_equals_full_forward(arch, fmt, tmp_path_factory):
    _, folder = _saved(arch, fmt, tmp_path_factory)
    model = load_model(folder)
    ids = _ids(20, seed=5)
    full = model.forward(ids, np.arange(20), ContiguousKVCache.for_model(model.config, 20))
    cache = ContiguousKVCache.for_model(model.config, 20)
    # a chunked prefill (8 then 5) and then one token at a time, reading only the needed rows
    rows = [model.forward(ids[:8], np.arange(8), cache, logits_rows=[7])]
    rows.append(model.forward(ids[8:13], np.arange(8, 13), cache))
    for i in range(13, 20):
        assert cache.length == i
        rows.append(model.forward(ids[i : i + 1], np.array([i]), cache))
    np.testing.assert_allclose(np.concatenate(rows), full[7:], atol=1e-5, rtol=0)


def test_bert_embed_is_mean_pooled_and_normalized(tmp_path_factory):
    ref, folder = _saved("bert", "safetensors", tmp_path_factory)
    model = load_model(folder)
    ids = np.stack([_ids(9, seed=7), _ids(9, seed=8)])
    mask = np.ones_like(ids)
    mask[1, 4:] = 0
    with torch.no_grad():
        h = ref(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).last_hidden_state
        m = torch.tensor(mask)[:, :, None].float()
        want = torch.nn.functional.normalize((h * m).sum(1) / m.sum(1), dim=-1).numpy()
    got = model.embed(ids, mask)
    assert np.abs(got - want).max() <= TOL


class TwoSequences:
    """The engine's side of the attention contract, in miniature: tokens of two sequences packed
    into one forward, each routed to its own cache by a per-token sequence index."""

    def __init__(self, config, seq_of_token, max_len=32):
        self.caches = [ContiguousKVCache.for_model(config, max_len) for _ in range(2)]
        self.seq_of_token = np.asarray(seq_of_token)

    def __call__(self, layer, q, k, v):
        out = np.empty_like(q)
        for s, cache in enumerate(self.caches):
            rows = np.flatnonzero(self.seq_of_token == s)
            out[rows] = cache(layer, q[rows], k[rows], v[rows])
        return out


@_cases(["llama", "gpt2"])
def test_packed_sequences_equal_separate_forwards(arch, fmt, tmp_path_factory):
    _, folder = _saved(arch, fmt, tmp_path_factory)
    model = load_model(folder)
    a, b = _ids(7, seed=11), _ids(4, seed=12)
    alone = [model.forward(x, np.arange(len(x)), ContiguousKVCache.for_model(model.config, 16)) for x in (a, b)]
    # interleaved on purpose: positions are per token, not per batch
    order = np.array([0, 1, 0, 0, 1, 0, 1, 1, 0, 0, 0])
    ids = np.empty(11, dtype=np.int64)
    pos = np.empty(11, dtype=np.int64)
    ids[order == 0], ids[order == 1] = a, b
    pos[order == 0], pos[order == 1] = np.arange(7), np.arange(4)
    packed = model.forward(ids, pos, TwoSequences(model.config, order), logits_rows=np.arange(11))
    np.testing.assert_allclose(packed[order == 0], alone[0], atol=1e-5)
    np.testing.assert_allclose(packed[order == 1], alone[1], atol=1e-5)
