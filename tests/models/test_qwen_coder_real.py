"""The real Qwen2.5-Coder 0.5B and 1.5B files (Q4_K_M GGUF) against transformers, which loads the
same file with `gguf_file=` and dequantizes it to float32.

Greedy ids of our exact path (dtype "quantized", whose logits equal the dequantized float32
model's) equal transformers' on a chat prompt in the model's template, code, Chinese and a
prompt of 3,000 tokens, up to the first step where transformers' own top two are nearly tied
(then either pick is right). Transformers' logits are read at our picks (one forward over the
prompt and our tokens), so a step's comparison does not depend on an earlier near-tie.

The module runs with `SCRATCHLLM_TEST_LARGE=1` (about 6 minutes on 2 cores, where the whole suite
has 15): reading a file into transformers alone takes 40 s for the 0.5B. `make test` checks the
0.5B's exact path against transformers' greedy ids on every run all the same, through
fill-in-the-middle prompts (tests/server/test_fim_real.py)."""

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from scratchllm.formats.refs import resolve_model  # noqa: E402
from scratchllm.models import ContiguousKVCache, load_model  # noqa: E402
from scratchllm.tokenizer import Tokenizer  # noqa: E402
from tests.gguf_reference import file_config, gguf_model, steps_before_near_tie  # noqa: E402

LARGE = os.environ.get("SCRATCHLLM_TEST_LARGE") == "1"
pytestmark = [pytest.mark.slow, pytest.mark.skipif(not LARGE, reason="minutes of transformers on 2 cores: "
                                                   "SCRATCHLLM_TEST_LARGE=1 runs it")]

NEAR_TIE = 1e-3  # of the largest |logit|
STEPS = 12
MODELS = ["qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"]
CHAT = [{"role": "user", "content": "Write a Python function that checks whether a string is a palindrome."}]
CODE = "import os\n\n\ndef list_python_files(root):\n    "
CHINESE = "请用一句话解释什么是递归函数。"


def _long_prompt(tok: Tokenizer) -> list[int]:
    """A module of 3,000 tokens or a little more, ending where the next function begins."""
    parts = ["# inventory.py: records of a small shop\n\n"]
    i = 0
    while len(tok.encode("".join(parts))) < 3000:
        parts.append(f"def item_{i}_total(count, price):\n"
                     f"    \"\"\"Item {i}: {i * 7 % 13} in stock, reordered at {i * 5 % 11}.\"\"\"\n"
                     f"    return count * price + {i * 3 % 17}\n\n\n")
        i += 1
    return tok.encode("".join(parts) + "def item_")


@pytest.fixture(scope="module", params=MODELS)
def pair(request):
    """(our exact model, its tokenizer, transformers' reading of the same file)."""
    name = request.param
    path = resolve_model(name)
    config = file_config(path)
    config._attn_implementation = "sdpa"
    reference = gguf_model(path, config)
    return load_model(name, dtype="quantized"), Tokenizer.from_pretrained(name), reference


def _ours_greedy(model, prompt: list[int], steps: int) -> list[int]:
    cache = ContiguousKVCache.for_model(model.config, len(prompt) + steps)
    logits = model.forward(np.array(prompt), np.arange(len(prompt)), cache, logits_rows=[len(prompt) - 1])
    got: list[int] = []
    for step in range(steps):
        got.append(int(logits[-1].argmax()))
        logits = model.forward(np.array(got[-1:]), np.array([len(prompt) + step]), cache)
    return got


def _check(pair, prompt: list[int]) -> int:
    """Our greedy ids against transformers' argmax at each step up to its first near-tie; the
    steps checked."""
    model, _, reference = pair
    got = _ours_greedy(model, prompt, STEPS)
    with torch.no_grad():
        want = reference(torch.tensor([prompt + got]), logits_to_keep=STEPS + 1).logits[0].numpy()
    return steps_before_near_tie(got, want, NEAR_TIE)


@pytest.mark.parametrize("kind", ["chat", "code", "chinese"])
def test_greedy_ids_equal_transformers(pair, kind):
    tok = pair[1]
    text = {"chat": lambda: tok.apply_chat_template(CHAT, add_generation_prompt=True),
            "code": lambda: CODE, "chinese": lambda: CHINESE}[kind]()
    assert _check(pair, tok.encode(text)) >= 4


def test_greedy_ids_equal_transformers_after_3000_tokens(pair):
    prompt = _long_prompt(pair[1])
    assert 3000 <= len(prompt) < 3100
    assert _check(pair, prompt) >= 4
