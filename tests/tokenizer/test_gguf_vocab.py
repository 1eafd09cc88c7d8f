"""The GGUF tokenizer tables (tokenizer/gguf_vocab.py, tokenizer/_merge_ranks.pyx): the merge
ranks equal llama.cpp's rule written out plainly here, on SmolLM2's 48900 merges and on the lines
where a shortcut would go wrong; a caller's already parsed metadata gives the same tokenizer as
the file; malformed vocabularies are refused with a FormatError."""

import gc

import pytest

from scratchllm.errors import FormatError
from scratchllm.formats.gguf import GGUFFile
from scratchllm.tokenizer.gguf_vocab import from_gguf, merge_ranks


def rule(merges: list[str]) -> dict[tuple[str, str], int]:
    """llama.cpp's llm_tokenizer_bpe: cut at the first space after the first character
    (`line.find(' ', 1)`); tokenizers' BPE keeps the first rank of a repeated pair."""
    ranks: dict[tuple[str, str], int] = {}
    for rank, line in enumerate(merges):
        cut = line.find(" ", 1)
        assert cut >= 0
        ranks.setdefault((line[:cut], line[cut + 1:]), rank)
    return ranks


@pytest.fixture(scope="module")
def smollm_meta(default_gguf):
    return GGUFFile(default_gguf).metadata


def test_merge_ranks_of_the_default_model_follow_the_rule(smollm_meta):
    merges = smollm_meta["tokenizer.ggml.merges"]
    ours = merge_ranks(merges, "x")
    assert ours == rule(merges) and len(ours) == 48900
    assert list(ours.items())[:2] == [(("Ġ", "t"), 0), (("Ġ", "a"), 1)]
    # The pairs are untracked by the cyclic GC (strings only, no cycle possible): collections
    # during the rest of loading do not walk them.
    assert not any(gc.is_tracked(pair) for pair in list(ours)[:1000])


@pytest.mark.parametrize("lines", [
    ["a b", "c d"],
    [" a b", "x y"],  # a leading space belongs to the left half
    ["a  b"],  # the cut is the first space: the right half starts with one
    ["a b c"],  # further spaces belong to the right half
    ["a b", "c d", "a b"],  # listed twice: the first rank stays
    ["Ġ t", "Ġt he", "é ü", "你 好", "🤗 x"],  # multi-byte characters on both sides
    ["  "],  # the first character is the space; the second is the cut: (" ", "")
])
def test_merge_ranks_edge_lines(lines):
    assert merge_ranks(lines, "x") == rule(lines)


@pytest.mark.parametrize("line", ["ab", "", " ", "a"])
def test_a_merge_without_its_space_is_refused(line):
    with pytest.raises(FormatError, match=f"merge {line!r} has no space"):
        merge_ranks(["a b", line], "file.gguf")


def test_parsed_metadata_gives_the_same_tokenizer_as_the_file(default_gguf, smollm_meta):
    a, b = from_gguf(default_gguf), from_gguf(default_gguf, smollm_meta)
    assert a.id_to_token == b.id_to_token and a.model.vocab == b.model.vocab and a.model.ranks == b.model.ranks
    assert (a.added, a.special_ids, a.prefix_ids, a.bos_token_id, a.eos_token_id, a.chat_template) == \
        (b.added, b.special_ids, b.prefix_ids, b.bos_token_id, b.eos_token_id, b.chat_template)


def _meta(**changes):
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b", "ab"],
            "tokenizer.ggml.token_type": [1, 1, 1], "tokenizer.ggml.merges": ["a b"]}
    meta.update(changes)
    return meta


@pytest.mark.parametrize("changes, message", [
    ({"tokenizer.ggml.tokens": [1, 2, 3]}, "tokenizer.ggml.tokens must be an array of strings"),
    ({"tokenizer.ggml.tokens": "ab"}, "tokenizer.ggml.tokens must be an array of strings"),
    ({"tokenizer.ggml.merges": [7]}, "tokenizer.ggml.merges must be an array of strings"),
    ({"tokenizer.ggml.token_type": ["1", "1", "1"]}, "token_type must be an array of integers"),
    ({"tokenizer.ggml.token_type": [1, 1]}, "3 tokens but 2 token types"),
    ({"tokenizer.ggml.merges": ["a b", "ab"]}, "merge 'ab' has no space"),
])
def test_malformed_vocabularies_are_refused(changes, message):
    with pytest.raises(FormatError, match=message):
        from_gguf("bad.gguf", _meta(**changes))


def test_a_small_vocabulary_reads_as_written():
    spec = from_gguf("small.gguf", _meta(**{"tokenizer.ggml.token_type": [1, 1, 3]}))
    assert spec.model.vocab == {"a": 0, "b": 1, "ab": 2} and spec.model.ranks == {("a", "b"): 0}
    assert spec.added == {"ab": 2} and spec.special_ids == {2}
