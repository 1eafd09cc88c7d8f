"""The n-gram proposer against the rule written out as a rescan (vLLM's `ngram` method: the
longest n in [min, max] whose last n tokens occurred earlier, their first occurrence, up to k
tokens after it)."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scratchllm.engine.speculative.ngram import NgramIndex


def rescan(tokens, min_n, max_n, k):
    """The rule, the slow way: every n from the longest, every earlier start, first match wins."""
    L = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        if n >= L:
            continue
        suffix = tokens[L - n :]
        for i in range(L - n):  # occurrences that end before the last token
            if tokens[i : i + n] == suffix:
                return tokens[i + n : i + n + k]
    return []


VOCAB: dict[str, int] = {}


def ids(text):
    """Words as token ids (each distinct word its own id)."""
    return [VOCAB.setdefault(w, len(VOCAB)) for w in text.split()]


def test_code_edit_copies_the_prompt():
    # the answer started copying a line of the prompt: the draft is the rest of that line
    idx = NgramIndex(2, 4, ids("def area ( r ) : return 3.14 * r * r") + ids("def area ( r ) :"))
    assert idx.propose(5) == ids("return 3.14 * r *")
    assert idx.propose(3) == ids("return 3.14 *")


def test_first_occurrence_and_longest_n():
    # "a b" occurs at 0 and 3; "x a b" only at 2..4: the longer n-gram wins over the earlier short one
    seq = ids("a b c x a b d x a b")
    assert NgramIndex(2, 3, seq).propose(2) == ids("d x")
    # with max_n 2 the first "a b" wins
    assert NgramIndex(2, 2, seq).propose(2) == ids("c x")


def test_no_match_no_draft_and_min_n():
    assert NgramIndex(2, 4, [1, 2, 3, 4, 5]).propose(5) == []
    assert NgramIndex(2, 4, [7, 1, 9, 1]).propose(5) == []  # a unigram repeats, min_n is 2
    assert NgramIndex(1, 4, [7, 1, 9, 1]).propose(5) == [9, 1]
    assert NgramIndex(2, 4, [1, 2, 1, 2]).propose(0) == []


def test_overlapping_occurrence_and_short_tail():
    # "a a" ends at index 1 and at the end: the continuation is only what exists after it
    assert NgramIndex(2, 3, ids("a a a")).propose(5) == ids("a")


def test_incremental_equals_built_at_once():
    rng = random.Random(0)
    tokens = [rng.randrange(6) for _ in range(300)]
    idx = NgramIndex(2, 4)
    for i, t in enumerate(tokens):
        idx.extend([t])
        assert idx.propose(4) == rescan(tokens[: i + 1], 2, 4, 4)
    idx2 = NgramIndex(2, 4)
    idx2.sync(tokens[:100])
    idx2.sync(tokens)
    assert idx2.first == idx.first


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=0, max_size=60), st.integers(1, 4), st.integers(0, 3), st.integers(0, 6))
def test_matches_the_rescan(tokens, min_n, extra, k):
    max_n = min_n + extra
    assert NgramIndex(min_n, max_n, tokens).propose(k) == rescan(tokens, min_n, max_n, k)


def test_bad_sizes_are_refused():
    with pytest.raises(AssertionError):
        NgramIndex(3, 2)
