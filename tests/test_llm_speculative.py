"""The Python API takes vLLM's speculative_config, and LLM.chat answers the same with and without
it (greedy): n-gram lookup, and a draft model (the default model drafting for itself: the same
vocabulary, every draft accepted; `scratchllm bench spec` checks qwen2.5-coder-0.5b drafting for
qwen2.5-coder-1.5b the same way, on its prompt sets)."""

import pytest

from scratchllm import LLM, SamplingParams
from scratchllm.errors import ConfigError

pytestmark = pytest.mark.slow

EDIT = [{"role": "user", "content": "Add a docstring to this function and return all of it:\n\n```python\n"
                                    "def mean(values):\n    total = 0\n    for v in values:\n        total += v\n"
                                    "    return total / len(values)\n```"}]
GREEDY = SamplingParams(max_tokens=48, temperature=0.0)


@pytest.mark.parametrize("model, spec", [
    ("default", {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4}),
    ("default", {"model": "default", "num_speculative_tokens": 5, "adaptive": False}),
], ids=["ngram", "draft-model"])
def test_chat_is_the_same_with_and_without_speculation(model, spec):
    plain = LLM(model, threads=2).chat(EDIT, GREEDY)
    llm = LLM(model, threads=2, speculative_config=spec)
    got = llm.chat(EDIT, GREEDY)
    assert got.token_ids == plain.token_ids and got.text == plain.text
    assert got.metrics.spec_drafted > 0 and llm.stats().spec_decode_num_drafts > 0


def test_a_bad_speculative_config_is_one_clear_error():
    with pytest.raises(ConfigError, match="speculative config: num_speculative_tokens is required"):
        LLM("default", speculative_config={"method": "ngram"})
