"""The compact vocabulary (tokenizer/_vocabulary.pyx) against the dict it replaces,
dict(zip(tokens, range(n))): every lookup, hit or miss, gives the dict's answer, on SmolLM2's
49152 tokens and on generated vocabularies that list texts twice and mix storage widths
(ASCII, Latin-1, U+0100.., U+1F917), and the texts by id equal the list they came from."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scratchllm.formats.gguf import GGUFFile
from scratchllm.tokenizer._vocabulary import TokenTexts, Vocabulary

ALPHABET = "ab~é\u0120\u0143你\U0001F917 "


def check(tokens: list[str], probes: list) -> None:
    reference = dict(zip(tokens, range(len(tokens)), strict=True))
    vocab = Vocabulary(tokens)
    assert len(vocab) == len(reference) and dict(vocab.items()) == reference
    for probe in [*tokens, *probes]:
        assert vocab.get(probe, -7) == reference.get(probe, -7), probe
        assert (probe in vocab) == (probe in reference)
    texts = TokenTexts(vocab)
    assert len(texts) == len(tokens) and list(texts) == tokens and texts == tokens
    if tokens:
        assert texts[-1] == tokens[-1] and texts[1:3] == tokens[1:3]
    word = "".join(tokens[:20]) + "z\U0001F600"
    assert vocab.symbols(word) == [reference.get(c, -1) for c in word]


def test_the_default_vocabulary(default_gguf):
    tokens = GGUFFile(default_gguf).metadata["tokenizer.ggml.tokens"]
    near = [t + "q" for t in tokens[::7]] + [t[:-1] for t in tokens[::5]] + [t.upper() for t in tokens[::11]]
    check(tokens, near + ["", " ", "\U0001F917", 3, None, b"a"])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text(alphabet=ALPHABET, max_size=4), max_size=60),
       st.lists(st.text(alphabet=ALPHABET, max_size=4), max_size=30))
def test_generated_vocabularies(tokens, probes):
    check(tokens, probes)


def test_refusals():
    with pytest.raises(TypeError):
        Vocabulary(["a", 3])
    texts = TokenTexts(Vocabulary(["a"]))
    with pytest.raises(IndexError):
        texts[1]
    with pytest.raises(KeyError):
        Vocabulary(["a"])["b"]
