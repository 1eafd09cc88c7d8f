"""The token diff: edit distance against published values and the textbook recurrence,
first divergence, aligned spans and context."""

import functools

from hypothesis import given
from hypothesis import strategies as st

from scratchllm.evaluate.diff import edit_distance, first_divergence, token_diff


def test_edit_distance_published_examples():
    assert edit_distance("kitten", "sitting") == 3  # Levenshtein's usual example
    assert edit_distance("flaw", "lawn") == 2
    assert edit_distance("", "abc") == 3
    assert edit_distance(["a", "b"], ["a", "b"]) == 0


def _reference(a, b):
    @functools.cache
    def d(i, j):  # the recurrence as defined: distance of a[:i] and b[:j]
        if min(i, j) == 0:
            return max(i, j)
        return min(d(i - 1, j) + 1, d(i, j - 1) + 1, d(i - 1, j - 1) + (a[i - 1] != b[j - 1]))
    return d(len(a), len(b))


@given(st.lists(st.integers(0, 3), max_size=9), st.lists(st.integers(0, 3), max_size=9))
def test_edit_distance_equals_the_recurrence(a, b):
    assert edit_distance(a, b) == _reference(a, b)


def test_first_divergence_and_spans():
    a, b = [1, 2, 3, 4, 5], [1, 2, 9, 4, 5, 6]
    assert first_divergence(a, a) is None
    assert first_divergence(a, b) == 2
    assert first_divergence([1, 2], [1, 2, 3]) == 2
    d = token_diff(a, b, [f"<{t}>" for t in a], [f"<{t}>" for t in b], "<1><2><3>", "<1><2><9>")
    assert d.first_divergence == 2 and d.edit_distance == 2
    assert d.spans == (("equal", 0, 2, 0, 2), ("replace", 2, 3, 2, 3), ("equal", 3, 5, 3, 5),
                       ("insert", 5, 5, 5, 6))
    assert d.context_a == "<1><2>⟦<3><4><5>" and d.context_b == "<1><2>⟦<9><4><5><6>"
    assert d.common_prefix_chars == len("<1><2><")
