"""The real Gemma 3 270M (Q4_K_M GGUF, tensors Q4_K / Q6_K / Q5_0 / Q8_0 / F32) against
transformers, which loads the same file with `gguf_file=` and dequantizes it to float32.

Logits within 1e-3 of the largest |logit| on three prompts, and greedy tokens equal on a prompt
longer than the 512-token sliding window of five layers in six, up to the first step where
transformers' own top two are nearly tied (then either pick is right)."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from scratchllm.formats.refs import resolve_model  # noqa: E402
from scratchllm.models import ContiguousKVCache, load_model  # noqa: E402
from scratchllm.tokenizer import Tokenizer  # noqa: E402
from tests.gguf_reference import file_config, gguf_model, steps_before_near_tie  # noqa: E402

pytestmark = pytest.mark.slow

TOL = 1e-3
NEAR_TIE = 1e-3  # of the largest logit
PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, in a small village,"]


@pytest.fixture(scope="module")
def reference():
    """transformers' reading of the file: its config and its dequantized, renamed tensors (what
    from_pretrained(gguf_file=) does, without the accelerate package it asks for)."""
    path = resolve_model("gemma3-270m")
    config = file_config(path)
    config._attn_implementation = "eager"
    return gguf_model(path, config)  # ~40 s: once


@pytest.fixture(scope="module")
def ours():
    return load_model("gemma3-270m", dtype="quantized"), Tokenizer.from_pretrained("gemma3-270m")  # exact path


def _ref_logits(reference, ids, keep):  # the last `keep` positions' logits
    with torch.no_grad():
        return reference(torch.tensor([ids]), logits_to_keep=keep).logits[0].numpy()


def test_config_reads_the_windows_and_rope_bases(ours):
    cfg = ours[0].config
    assert cfg.model_type == "gemma3" and cfg.num_layers == 18 and cfg.vocab_size == 262144
    assert [cfg.window(i) for i in range(6)] == [512] * 5 + [None]
    assert cfg.rope_base(0) == 10000.0 and cfg.rope_base(5) == 1e6 and cfg.arch.qk_norm and cfg.arch.sandwich_norms


@pytest.mark.parametrize("prompt", PROMPTS)
def test_logits_match_transformers(prompt, ours, reference):
    model, tok = ours
    ids = tok.encode(prompt)
    cache = ContiguousKVCache.for_model(model.config, len(ids))
    got = model.forward(np.array(ids), np.arange(len(ids)), cache)
    want = _ref_logits(reference, ids, len(ids))
    np.testing.assert_allclose(got, want, rtol=0, atol=TOL * np.abs(want).max())


def test_greedy_past_the_sliding_window(ours, reference):
    model, tok = ours
    text = " ".join(f"Line {i} of the ledger records {i * 7 % 13} apples and {i * 5 % 11} pears." for i in range(48))
    prompt = tok.encode(text + " The next line is")
    assert len(prompt) > 600  # the sliding layers now see only the last 512 of them
    steps = 12
    cache = ContiguousKVCache.for_model(model.config, len(prompt) + steps)
    logits = model.forward(np.array(prompt), np.arange(len(prompt)), cache, logits_rows=[len(prompt) - 1])
    got = []
    for step in range(steps):
        got.append(int(logits[-1].argmax()))
        logits = model.forward(np.array(got[-1:]), np.array([len(prompt) + step]), cache)
    want = _ref_logits(reference, prompt + got, steps + 1)  # transformers' logits before each of our picks
    checked = steps_before_near_tie(got, want, NEAR_TIE)
    assert checked >= 4, f"only {checked} steps before a near-tie"
