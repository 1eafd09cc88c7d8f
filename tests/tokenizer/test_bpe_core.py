"""The merge loop itself: the heap path for long pieces gives the list loop's merges, and a long
run of letters (one huge pre-token) stays fast and equal to tokenizers."""

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scratchllm import Tokenizer
from scratchllm.tokenizer import bpe
from scratchllm.tokenizer.bytelevel import text_to_bytelevel


@pytest.fixture(scope="module")
def model():
    return Tokenizer.from_pretrained("default").spec.model


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="aeinrst Ġ你好12", min_size=0, max_size=120))
def test_heap_merges_equal_list_merges(model, monkeypatch_module, text):
    word = text_to_bytelevel(text)
    with monkeypatch_module.context() as m:
        m.setattr(bpe, "HEAP_ABOVE", 10**9)  # force the list loop
        expected = model._merge(word)
    assert model._merge_heap(word) == expected
    assert "".join(expected) == word


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as m:
        yield m


def test_long_piece_is_fast_and_equal(smollm_reference):
    tok = Tokenizer.from_pretrained("default")
    text = "ab" * 20_000 + " " + "xyz" * 5_000 + " 12345" * 10
    start = time.perf_counter()
    ids = tok.encode(text)
    seconds = time.perf_counter() - start
    assert ids == smollm_reference.encode(text).ids
    assert seconds < 5.0, f"{len(text)} characters took {seconds:.1f} s"
