"""The GGUF tokenizer tables (tokenizer/gguf_vocab.py, tokenizer/_merge_ranks.pyx): the merge
ranks equal llama.cpp's rule written out plainly here, on SmolLM2's 48900 merges and on the lines
where a shortcut would go wrong; each pair's id merges to the id of its two texts joined; a
caller's already parsed metadata gives the same tokenizer as the file; malformed vocabularies are
refused with a FormatError."""

import pytest

from scratchllm.errors import FormatError
from scratchllm.formats.gguf import GGUFFile
from scratchllm.tokenizer._vocabulary import Vocabulary
from scratchllm.tokenizer.bpe import BPE
from scratchllm.tokenizer.gguf_vocab import from_gguf, merge_table


def merge_ranks(lines: list[str], path, tokens: list[str] | None = None) -> dict[tuple[str, str], int]:
    """Our table for `lines` over the vocabulary `tokens` (none: every text is an extra symbol),
    written back as {(left, right): rank}; every pair's product is the symbol of left + right."""
    tokens = tokens or []
    vocab = Vocabulary(tokens)
    model = BPE(vocab, merge_table(lines, path, vocab), len(tokens))
    ranks = model.ranks()
    text = {i: t for t, i in vocab.items()} | {i: t for t, i in model.extra.items()}
    assert all(text[model.table.product(rank)] == left + right for (left, right), rank in ranks.items())
    return ranks


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
    merges, tokens = smollm_meta["tokenizer.ggml.merges"], smollm_meta["tokenizer.ggml.tokens"]
    ours = merge_ranks(merges, "x", tokens)
    assert ours == rule(merges) and len(ours) == 48900
    assert list(ours.items())[:2] == [(("Ġ", "t"), 0), (("Ġ", "a"), 1)]
    # Every half and product of this file is a token: no extra symbols.
    assert not from_gguf("x", smollm_meta).model.extra


def test_products_guessed_from_positions_are_checked():
    """The builder guesses each product's id from the one before (GPT-2 style order); a file in
    another order gets the ids its texts have."""
    tokens = ["a", "b", "c", "bc", "ab", "abc"]  # products of the lines below: 4, 3, 5 (no +1 run)
    lines = ["a b", "b c", "ab c"]
    for listed in (tokens, [*tokens, "a"]):  # the second lists a text twice: no guessing
        table, extra = merge_table(lines, "x", Vocabulary(listed))
        assert table.products_list() == [4, 3, 5] and not extra


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
    # Over vocabularies where the builder guesses each product's id (the one after the last
    # product's) and checks the guess in place: products in a row (the guesses hold), and each
    # product led by a near miss of its length (every guess fails): one character off, stored
    # narrower ('~'), or wider (U+0301, U+1F917).
    halves = list(dict.fromkeys(h for pair in rule(lines) for h in pair))
    products = [p for p in dict.fromkeys(left + right for left, right in rule(lines)) if p not in halves]
    assert merge_ranks(lines, "x", halves + products) == rule(lines)
    for last in ("~", "\u0301", "\U0001F917"):
        led = [t for p in products for t in (p[:-1] + last, p) if t not in halves]
        assert merge_ranks(lines, "x", halves + list(dict.fromkeys(led))) == rule(lines)


@pytest.mark.parametrize("line", ["ab", "", " ", "a"])
def test_a_merge_without_its_space_is_refused(line):
    with pytest.raises(FormatError, match=f"merge {line!r} has no space"):
        merge_ranks(["a b", line], "file.gguf")


def test_parsed_metadata_gives_the_same_tokenizer_as_the_file(default_gguf, smollm_meta):
    a, b = from_gguf(default_gguf), from_gguf(default_gguf, smollm_meta)
    assert a.id_to_token == b.id_to_token and a.model.vocab.items() == b.model.vocab.items()
    assert a.model.table.items() == b.model.table.items() and a.model.extra == b.model.extra
    assert a.model.table.products_list() == b.model.table.products_list()
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
    assert dict(spec.model.vocab.items()) == {"a": 0, "b": 1, "ab": 2} and spec.model.ranks() == {("a", "b"): 0}
    assert spec.added == {"ab": 2} and spec.special_ids == {2}
