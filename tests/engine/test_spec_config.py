"""SpeculativeConfig: vLLM's spellings and llama.cpp's, one clear error for bad input; a draft
model with another vocabulary is refused, naming the difference."""

from dataclasses import dataclass

import pytest

from scratchllm.engine.speculative.config import SpeculativeConfig
from scratchllm.engine.speculative.vocabulary import check_same_vocabulary
from scratchllm.errors import ConfigError


def test_vllm_ngram_spelling():
    c = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, '
                                '"prompt_lookup_min": 2}')
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == ("ngram", 5, 2, 4)
    assert not c.uses_draft_model
    # vLLM's defaults: neither size given -> 5 and 5; one given -> both
    assert SpeculativeConfig(method="ngram", num_speculative_tokens=3).prompt_lookup_min == 5
    one = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4})
    assert (one.prompt_lookup_min, one.prompt_lookup_max) == (4, 4)
    assert SpeculativeConfig.parse({"model": "[ngram]", "num_speculative_tokens": 2}).method == "ngram"


def test_vllm_draft_model_spelling():
    c = SpeculativeConfig.parse({"model": "qwen2.5-coder-0.5b", "num_speculative_tokens": 5})
    assert (c.method, c.model, c.num_speculative_tokens) == ("draft_model", "qwen2.5-coder-0.5b", 5)
    assert c.uses_draft_model and c.describe()["model"] == "qwen2.5-coder-0.5b"
    assert SpeculativeConfig.parse(None) is None and SpeculativeConfig.parse("null") is None
    assert SpeculativeConfig.parse(c) is c


def test_llama_cpp_spelling():
    c = SpeculativeConfig.from_llama_cpp("qwen2.5-coder-0.5b", draft_max=8, draft_min=2, draft_p_min=0.6)
    assert c is not None and (c.method, c.num_speculative_tokens, c.draft_min, c.draft_p_min) == \
        ("draft_model", 8, 2, 0.6)
    d = SpeculativeConfig.from_llama_cpp("m")
    assert d is not None and d.num_speculative_tokens == 3  # llama.cpp's default draft length
    assert SpeculativeConfig.from_llama_cpp(None) is None
    with pytest.raises(ConfigError, match="--draft-max needs --model-draft"):
        SpeculativeConfig.from_llama_cpp(None, draft_max=4)


@pytest.mark.parametrize("value, message", [
    ('{"method": "ngram"', "not valid JSON"),
    ("[1]", "must be a JSON object"),
    ({"method": "ngram"}, "num_speculative_tokens is required"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be an integer in"),
    ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens must be"),
    ({"method": "eagle", "num_speculative_tokens": 3}, "'eagle' is not available here"),
    ({"method": "magic", "num_speculative_tokens": 3}, "method must be one of ngram, draft_model"),
    ({"num_speculative_tokens": 3}, "give a method"),
    ({"method": "draft_model", "num_speculative_tokens": 3}, "needs \"model\""),
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min=4 must be <= prompt_lookup_max=2"),
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 0}, "prompt_lookup_min must be"),
    ({"model": "m", "num_speculative_tokens": 3, "prompt_lookup_max": 2}, "ngram method's"),
    ({"method": "ngram", "num_speculative_tokens": 3, "model": "m"}, "takes no model"),
    ({"method": "ngram", "num_speculative_tokens": 3, "draft_min": 4}, "draft_min must be"),
    ({"model": "m", "num_speculative_tokens": 3, "draft_p_min": 2}, "draft_p_min must be"),
    ({"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 0}, "disable_by_batch_size must"),
    ({"method": "ngram", "num_speculative_tokens": 3, "quantization": "fp8"}, "unknown key\\(s\\) quantization"),
])
def test_bad_input_is_one_clear_error(value, message):
    with pytest.raises(ConfigError, match=message):
        SpeculativeConfig.parse(value)


@dataclass
class Vocab:
    texts: list[str]
    eos_token_id: int | None = 0

    @property
    def vocab_size(self):
        return len(self.texts)

    def id_to_token(self, i):
        return self.texts[i]


def test_a_draft_with_another_vocabulary_is_refused_naming_the_difference():
    target = Vocab(["<eos>", "a", "b", "c"])
    check_same_vocabulary(target, Vocab(["<eos>", "a", "b", "c"]), 4, 4)
    with pytest.raises(ConfigError, match="token 2 is 'x' in the draft and 'b' in the target"):
        check_same_vocabulary(target, Vocab(["<eos>", "a", "x", "c"]), 4, 4)
    with pytest.raises(ConfigError, match="3 tokens, the target has 4"):
        check_same_vocabulary(target, Vocab(["<eos>", "a", "b"]), 4, 4)
    with pytest.raises(ConfigError, match="end token 3, the target's is 0"):
        check_same_vocabulary(target, Vocab(["<eos>", "a", "b", "c"], 3), 4, 4)
    with pytest.raises(ConfigError, match="logits over 8 token ids, the target's over 4"):
        check_same_vocabulary(target, target, 4, 8)
