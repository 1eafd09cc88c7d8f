"""Streaming detokenization: pieces are complete text and join to exactly decode(ids)."""

import pytest

from scratchllm import Tokenizer


@pytest.fixture(scope="module", params=["default", "minilm"])
def tok(request):
    return Tokenizer.from_pretrained(request.param)


def _stream(tok, ids, **kw):
    detok = tok.detokenizer(**kw)
    pieces = [detok.push(i) for i in ids]
    return pieces, detok.flush()


def test_pieces_join_to_decode(tok, all_docs):
    for _, text in all_docs[-30:]:
        ids = tok.encode(text)
        for skip in (False, True):
            pieces, tail = _stream(tok, ids, skip_special_tokens=skip)
            assert "".join(pieces) + tail == tok.decode(ids, skip_special_tokens=skip)
            assert tail == ""


def test_only_complete_characters_are_emitted():
    tok = Tokenizer.from_pretrained("default")
    text = "家族 👨‍👩‍👧‍👦 and 🇫🇷 fine"
    ids = tok.encode(text)
    pieces, tail = _stream(tok, ids)
    assert "".join(pieces) == text and tail == ""
    assert not any("\ufffd" in p for p in pieces)
    # Some emoji span several tokens: those tokens emit nothing until the character completes.
    held = [i for i, p in zip(ids, pieces, strict=True) if p == "" and tok.token_bytes(i)]
    assert held, "expected tokens that end inside a character"


def test_cut_character_is_flushed_as_replacement():
    tok = Tokenizer.from_pretrained("default")
    ids = tok.encode("🙂")
    assert len(ids) > 1
    pieces, tail = _stream(tok, ids[:-1])
    assert "".join(pieces) == "" and tail == tok.decode(ids[:-1]) and "\ufffd" in tail


@pytest.mark.parametrize("bad", [-1, 10**6])
def test_ids_outside_the_vocabulary_are_refused(tok, bad):
    from scratchllm.errors import ConfigError

    with pytest.raises(ConfigError, match="outside the vocabulary"):
        tok.decode([5, bad])
    with pytest.raises(ConfigError, match="outside the vocabulary"):
        tok.detokenizer().push(bad)
