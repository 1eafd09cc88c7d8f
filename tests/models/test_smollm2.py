"""The real default model (SmolLM2-135M-Instruct, Q4_1 GGUF) against transformers reading the same file.

transformers dequantizes the GGUF to float32 with the `gguf` package, so both sides compute on
equal weights; the first test proves that (and with it our dequantization, name mapping and the
undoing of llama.cpp's q/k row permutation), the others compare what is computed from them.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from scratchllm.models import ContiguousKVCache, load_model  # noqa: E402
from tests.gguf_reference import gguf_model  # noqa: E402

pytestmark = pytest.mark.slow

# <|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n
# (the ids llama.cpp and transformers both feed for it)
CHAT_PROMPT = [1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198]


@pytest.fixture(scope="module")
def reference(default_gguf):
    """transformers' LlamaForCausalLM with the GGUF's weights, dequantized by the `gguf` package."""
    return gguf_model(default_gguf)


@pytest.fixture(scope="module")
def ours():
    return load_model("default", dtype="float32")  # the reference's numbers; the default dtype is checked against it


def test_weights_equal_transformers_dequantized(reference, ours):
    ref = reference.state_dict()
    names = [n for n in ref if n != "lm_head.weight"]
    assert set(names) == set(ours.weights)
    for name in names:
        np.testing.assert_array_equal(ours.weights[name], ref[name].numpy(), err_msg=name)


def test_logits_equal_transformers(reference, ours):
    ids = np.array(CHAT_PROMPT)
    with torch.no_grad():
        want = reference(torch.tensor(ids)[None]).logits[0].numpy()
    got = ours.forward(ids, np.arange(len(ids)), ContiguousKVCache.for_model(ours.config, len(ids)))
    assert np.abs(got - want).max() <= 1e-3, np.abs(got - want).max()


def _hf_greedy(model, ids, n):
    out, past, x = [], None, torch.tensor(ids)[None]
    with torch.no_grad():
        for _ in range(n):
            step = model(x, cache=past, use_cache=True)
            past = step.cache
            out.append(int(step.logits[0, -1].argmax()))
            x = torch.tensor([[out[-1]]])
    return out


def _our_greedy(model, ids, n):
    cache = ContiguousKVCache.for_model(model.config, len(ids) + n)
    logits = model.forward(np.array(ids), np.arange(len(ids)), cache, logits_rows=[len(ids) - 1])
    out = []
    for _ in range(n):
        out.append(int(logits[-1].argmax()))
        logits = model.forward(np.array(out[-1:]), np.array([cache.length]), cache)
    return out


def test_first_32_greedy_tokens_identical(reference, ours):
    # past the end-of-turn token on purpose: 32 tokens run through a near-tie at token 30, where the
    # top-1/top-2 logit gap is 0.05 (llama.cpp and transformers agree token for token up to there)
    want = _hf_greedy(reference, CHAT_PROMPT, 32)
    assert _our_greedy(ours, CHAT_PROMPT, 32) == want


def test_answers_paris(ours):
    from scratchllm import Tokenizer

    tok = Tokenizer.from_pretrained("default")
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    ids = _our_greedy(ours, tok.encode(prompt), 12)
    answer = tok.decode(ids[: ids.index(tok.eos_token_id)] if tok.eos_token_id in ids else ids)
    assert "Paris" in answer, answer


def test_quantized_weights_give_the_float32_logits_bit_for_bit(reference, ours):
    # dtype "quantized" keeps the file's Q4_1 / Q8_0 blocks and dequantizes inside the GEMM: the
    # same weights (checked against transformers' dequantization) and the same logits, exactly.
    # (The default dtype, "auto", is "int16" for this file where the CPU has VNNI dot products:
    # tests/bench/test_accuracy.py bounds it.)
    q = load_model("default", dtype="quantized")
    assert q.dtype == "quantized"
    assert q.params.layers[0].qkv.dtype == "quantized" and q.params.lm_head.dtype == "quantized"
    ref = reference.state_dict()
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.7.self_attn.k_proj.weight",
                 "model.layers.29.mlp.down_proj.weight", "model.embed_tokens.weight"):
        np.testing.assert_array_equal(q.weights[name], ref[name].numpy(), err_msg=name)
    ids = np.array(CHAT_PROMPT)
    args = (ids, np.arange(len(ids)))
    got = q.forward(*args, ContiguousKVCache.for_model(q.config, len(ids)))
    want = ours.forward(*args, ContiguousKVCache.for_model(ours.config, len(ids)))
    np.testing.assert_array_equal(got, want)
    assert _our_greedy(q, CHAT_PROMPT, 8) == _our_greedy(ours, CHAT_PROMPT, 8)
