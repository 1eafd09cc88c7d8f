"""The pre-tokenizer regexes of the GGUF families, against Hugging Face tokenizers' pre-tokenizers
written the way those models' tokenizer.json files write them (a different regex engine and, for
Llama 3 and Qwen2, a different spelling of the same rule)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scratchllm.tokenizer.bytelevel import text_to_bytelevel
from scratchllm.tokenizer.pretokenize import DIGIT_PATTERN, GGUF_PRETOKENIZERS, GPT2_PATTERN, PreTokenizer, Split

tk = pytest.importorskip("tokenizers")
pre = tk.pre_tokenizers

# As in Meta-Llama-3's and Qwen2's tokenizer.json.
HF_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
             r"|\s*[\r\n]+|\s+(?!\S)|\s+")
HF_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
            r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def _byte_level_after(split):
    return pre.Sequence([split, pre.ByteLevel(add_prefix_space=False, use_regex=False)])


REFERENCES = {
    # llama.cpp's fallback list, written as tokenizers' Split steps
    "default": lambda: _byte_level_after(pre.Sequence([
        pre.Split(tk.Regex(r"[\p{P}\$\+<=>\^~\|]+"), behavior="isolated"),
        pre.Split(tk.Regex(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""),
                  behavior="isolated"),
        pre.Split(tk.Regex(r"\p{N}+"), behavior="isolated"),
        pre.Split(tk.Regex(r"[0-9][0-9][0-9]"), behavior="isolated"),
    ])),
    "gpt2": lambda: pre.ByteLevel(add_prefix_space=False, use_regex=True),
    "smollm": lambda: pre.Sequence([pre.Digits(individual_digits=True),
                                    pre.ByteLevel(add_prefix_space=False, use_regex=True)]),
    "llama-bpe": lambda: _byte_level_after(pre.Split(tk.Regex(HF_LLAMA3), behavior="isolated")),
    "qwen2": lambda: _byte_level_after(pre.Split(tk.Regex(HF_QWEN2), behavior="isolated")),
}


@pytest.mark.parametrize("kind", sorted(REFERENCES))
def test_pieces_equal_tokenizers(kind, all_docs):
    ours = PreTokenizer(GGUF_PRETOKENIZERS[kind])
    reference = REFERENCES[kind]()
    pieces = 0
    for category, text in all_docs:
        expected = [p for p, _ in reference.pre_tokenize_str(text)]
        got = [text_to_bytelevel(p) for p in ours(text)]
        assert got == expected, f"[{category}] {text[:60]!r}"
        assert "".join(ours(text)) == text
        pieces += len(got)
    assert pieces > 10_000


def test_split_behaviors():
    assert PreTokenizer([Split(r"\s+", "removed")])("  a b\n c ") == ["a", "b", "c"]
    assert PreTokenizer([Split(r"\w+|[^\w\s]+", "removed", invert=True)])("hi, you!") == ["hi", ",", "you", "!"]
    assert PreTokenizer([Split(r"-", "isolated")])("a-b--c") == ["a", "-", "b", "-", "-", "c"]
    assert PreTokenizer([])("") == []


@settings(max_examples=500, deadline=None)
@given(st.text(alphabet=" \t\n\r\u3000aZé中1٣²'s!.-_😀", max_size=40))
def test_fused_smollm_regex_equals_the_two_steps(text):
    two_steps = PreTokenizer([Split(DIGIT_PATTERN), Split(GPT2_PATTERN)])
    assert PreTokenizer(GGUF_PRETOKENIZERS["smollm"])(text) == two_steps(text)
