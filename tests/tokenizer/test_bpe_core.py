"""The merge loop itself: the heap path for long pieces gives the list loop's merges, merging ids
follows the rule over strings (texts that are no token included), and a long
run of letters (one huge pre-token) stays fast and equal to tokenizers."""

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scratchllm import Tokenizer
from scratchllm.errors import ConfigError
from scratchllm.tokenizer.bpe import BPE
from scratchllm.tokenizer.bytelevel import text_to_bytelevel


@pytest.fixture(scope="module")
def model():
    return Tokenizer.from_pretrained("default").spec.model


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="aeinrst Ġ你好12", min_size=0, max_size=120))
def test_heap_merges_equal_list_merges(model, text):
    word = text_to_bytelevel(text)
    expected = model.table.merge(model.symbols(word))
    assert model._merge_heap(model.symbols(word)) == expected
    # Every symbol here is a token: the merged ids spell the word.
    text_of = {i: t for t, i in model.vocab.items()}
    assert "".join(text_of[i] for i in expected) == word


def test_long_piece_is_fast_and_equal(smollm_reference):
    tok = Tokenizer.from_pretrained("default")
    text = "ab" * 20_000 + " " + "xyz" * 5_000 + " 12345" * 10
    start = time.perf_counter()
    ids = tok.encode(text)
    seconds = time.perf_counter() - start
    assert ids == smollm_reference.encode(text).ids
    assert seconds < 5.0, f"{len(text)} characters took {seconds:.1f} s"


def merge_texts(ranks: dict[tuple[str, str], int], word: str) -> list[str]:
    """The rule over strings, written plainly: merge the leftmost lowest-ranked adjacent pair
    until none has a rank."""
    symbols = list(word)
    while True:
        found = [(ranks[pair], i) for i, pair in enumerate(zip(symbols, symbols[1:], strict=False)) if pair in ranks]
        if not found:
            return symbols
        _, i = min(found)
        symbols[i : i + 2] = [symbols[i] + symbols[i + 1]]


# Halves and products that are no token ("c", "bc", "xbc"), and a character in no merge ("z").
VOCAB = {"a": 0, "b": 1, "x": 2, "ab": 3, "abab": 4, "xbcab": 5, "bcab": 6}
RANKS = {("a", "b"): 0, ("b", "c"): 1, ("x", "bc"): 2, ("ab", "ab"): 3, ("xbc", "ab"): 4, ("bc", "ab"): 5}


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="abcxz", min_size=0, max_size=80), st.sampled_from([None, 99]))
def test_ids_follow_the_string_rule_with_texts_that_are_no_token(word, unk):
    model = BPE.from_ranks(VOCAB, RANKS, unk_id=unk)
    expected = [VOCAB.get(s, unk) for s in merge_texts(RANKS, word)]
    assert model.encode_uncached(word) == [i for i in expected if i is not None]
    assert model._merge_heap(model.symbols(word)) == model.table.merge(model.symbols(word))


def test_ranks_written_back_as_text():
    assert BPE.from_ranks(VOCAB, RANKS).ranks() == RANKS


def test_a_vocabulary_with_one_id_twice_is_refused():
    with pytest.raises(ConfigError, match="gives one id \\(0\\) to 'b' and 'a'"):
        BPE.from_ranks({"a": 0, "b": 0}, {})


def test_pairs_of_one_rank_must_merge_to_one_text():
    with pytest.raises(ValueError, match="pairs of rank 0 merge to different texts"):
        BPE.from_ranks({"a": 0, "b": 1}, {("a", "b"): 0, ("b", "a"): 0})
