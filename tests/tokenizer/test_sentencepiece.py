"""The SentencePiece tokenizer from GGUF metadata, against transformers' tokenizer built from the
same file (AutoTokenizer.from_pretrained(folder, gguf_file=name)).

Fast tests: a small vocabulary written with the gguf package's GGUFWriter (byte fallback, merge
order, specials, decoding byte runs), checked against that reference too. Slow tests: the real
Gemma 3 270M file on a seeded mix of prose, code, CJK, emoji and whitespace runs.
"""

import random

import pytest

from scratchllm.errors import FormatError
from scratchllm.tokenizer import Tokenizer

S = "\u2581"
BYTES = [f"<0x{b:02X}>" for b in range(256)]
# id: 0-4 control, 5 user-defined, 6.. bytes, then the pieces. "bc" is listed before "ab", so it
# merges first although its score is the worse one: the file's order decides for Gemma.
PIECES = ["a", "b", "c", "d", S, "bc", "ab", S + "a", "abc", "cd", "bcd", "  "]


def write_spm(path, pieces=PIECES, arch="gemma3", **flags):
    import gguf

    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "\n", *BYTES, *pieces]
    types = [3, 3, 3, 3, 3, 4, *[6] * 256, *[1] * len(pieces)]
    scores = [0.0] * (6 + 256) + [float(i) for i in range(len(pieces))]  # the later, the higher
    w = gguf.GGUFWriter(str(path), arch)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    if flags.get("scores", True):
        w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_add_bos_token(flags.get("add_bos", True))
    w.add_add_eos_token(False)
    w.add_add_space_prefix(flags.get("prefix", False))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    return write_spm(tmp_path_factory.mktemp("spm") / "small.gguf")


def ids_of(tok, *texts):
    return [tok.token_to_id(t) for t in texts]


def test_merge_order_is_the_files_not_the_scores(small):
    tok = Tokenizer.from_pretrained(small)
    assert tok.encode("abc", add_special_tokens=False) == ids_of(tok, "abc")
    # "abd": (a, b) -> ab and (b, d) makes no piece.
    assert tok.encode("abd", add_special_tokens=False) == ids_of(tok, "ab", "d")
    # "abcd": bc (listed first) merges before ab and cd; then abc (listed before bcd).
    assert tok.encode("abcd", add_special_tokens=False) == ids_of(tok, "abc", "d")
    # "bcd": bc before cd (by score cd would win, and then nothing joins "b").
    assert tok.encode("bcd", add_special_tokens=False) == ids_of(tok, "bcd")
    assert tok.encode("dbc", add_special_tokens=False) == ids_of(tok, "d", "bc")
    # "▁a" is listed before "▁▁": both "▁a" pairs merge first.
    assert tok.encode(" a  a", add_special_tokens=False) == ids_of(tok, S + "a", S, S + "a")
    assert tok.encode("ab") == [2] + ids_of(tok, "ab")


def test_byte_fallback_and_decode(small):
    tok = Tokenizer.from_pretrained(small)
    ids = tok.encode("aé", add_special_tokens=False)
    assert ids == ids_of(tok, "a", "<0xC3>", "<0xA9>")
    assert tok.decode(ids) == "aé"
    # A run of bytes that is no UTF-8 becomes one U+FFFD per byte (tokenizers' ByteFallback).
    assert tok.decode(ids_of(tok, "<0xC3>", "a", "<0xE2>", "<0x82>")) == "\ufffda\ufffd\ufffd"
    # Streaming holds a byte run until it ends, and joins to decode's text.
    for ids in (tok.encode("x€y 🤗 é"), ids_of(tok, "<0xC3>", "a", "<0xE2>", "<0x82>")):
        d = tok.detokenizer()
        assert "".join(map(d.push, ids)) + d.flush() == tok.decode(ids)


def test_specials_and_spaces(small):
    tok = Tokenizer.from_pretrained(small)
    ids = tok.encode("<start_of_turn>ab\nc<eos>")
    assert ids == [2, 4] + ids_of(tok, "ab") + [5] + ids_of(tok, "c") + [1]
    assert tok.decode(ids, skip_special_tokens=True) == "ab\nc"
    # The file's "  " is read as "▁▁"; as a user-defined token it is not matched in raw text.
    assert tok.id_to_token(tok.token_to_id(S + S)) == S + S
    assert tok.decode(tok.encode("a  a", add_special_tokens=False)) == "a  a"


def test_other_architectures_merge_by_score_with_a_prefix_space(tmp_path):
    """The same small file as a llama one: merges by score (cd, the best, before bc and ab), and
    the prefix space the file asks for; against transformers' tokenizer of that file."""
    from transformers import AutoTokenizer

    path = write_spm(tmp_path / "llama.gguf", arch="llama", prefix=True)
    tok, ref = Tokenizer.from_pretrained(path), AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in SMALL_TEXTS:
        ids = ref.encode(text)
        assert tok.encode(text) == ids, text
        assert tok.decode(ids) == ref.decode(ids), text
    # "▁abcd": cd (the best score) first, then b + cd, then ▁a; Gemma's order gives abc, d
    assert tok.encode("abcd", add_special_tokens=False) == ids_of(tok, S + "a", "bcd")


def test_scores_are_needed_outside_the_gemma_family(tmp_path):
    with pytest.raises(FormatError, match="tokenizer.ggml.scores"):
        Tokenizer.from_pretrained(write_spm(tmp_path / "llama.gguf", arch="llama", scores=False))


@pytest.fixture(scope="module")
def small_reference(small):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(small.parent), gguf_file=small.name)


SMALL_TEXTS = ["abc", "abcd", "abd", " a  a", "aé", "  ", "   a", "\n\nab\n", "dcba", "a b c d ",
               "<start_of_turn>abc<eos>", "🤗 x", "bcbcbc", "aaaa", "  \t a"]


def test_small_vocabulary_matches_transformers(small, small_reference):
    tok = Tokenizer.from_pretrained(small)
    for text in SMALL_TEXTS:
        ids = small_reference.encode(text)
        assert tok.encode(text) == ids, text
        assert tok.decode(ids) == small_reference.decode(ids), text


# ---- the real file ---------------------------------------------------------------------------
FRAGMENTS = [
    "the", " quick", " brown fox", "  ", "   ", "\t", "\t\t", "\n", "\n\n", "\r\n", " ", "日本", "語",
    "你好，世界", "。", "🤗", "🧪", "👩‍👩‍👧", "🇯🇵", "’", "—", ",", ".", "!?", "x = [1, 2]", "{}", "();",
    "def f(a, b):", "    return a+b", "ꙮ", "\U00013000", "é", "ß", "Привет", " мир", "안녕", "١٢٣",
    "<start_of_turn>", "<end_of_turn>", "model", "user", "<bos>", "<unused7>", "©", "™", "\u00a0",
    "&nbsp;", "</div>", "> </", "#include <stdio.h>", "0x1F", "3.14159", "ＡＢＣ", "\x07",
]


def real_texts(docs: dict[str, list[str]], n: int = 600) -> list[str]:
    """The shared corpus (prose, code, CJK, emoji, numbers, whitespace runs), cut into 2000-character
    texts, then seeded mixes of fragments up to n texts."""
    rng = random.Random(20260)
    texts = [" leading", "trailing ", "  both  ", "", " ", "\n"]
    texts += [d[i:i + 2000] for group in docs.values() for d in group for i in range(0, min(len(d), 20_000), 2000)]
    while len(texts) < n:
        texts.append("".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(1, 16))))
    return texts


@pytest.fixture(scope="module")
def gemma():
    return Tokenizer.from_pretrained("gemma3-270m")


@pytest.fixture(scope="module")
def gemma_reference():
    from transformers import AutoTokenizer

    from scratchllm.formats.refs import resolve_model

    path = resolve_model("gemma3-270m")
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)  # ~40 s: once


@pytest.mark.slow
def test_gemma_ids_and_text_match_transformers(gemma, gemma_reference, docs):
    texts = real_texts(docs)
    assert len(texts) >= 500
    for text in texts:
        for special in (True, False):
            ids = gemma_reference.encode(text, add_special_tokens=special)
            assert gemma.encode(text, add_special_tokens=special) == ids, (text, special)
        for skip in (False, True):
            assert gemma.decode(ids, skip_special_tokens=skip) == gemma_reference.decode(ids, skip_special_tokens=skip)
        d = gemma.detokenizer()
        assert "".join(map(d.push, ids)) + d.flush() == gemma.decode(ids)


@pytest.mark.slow
def test_gemma_facts(gemma, gemma_reference):
    assert gemma.vocab_size == len(gemma_reference) == 262144
    assert (gemma.bos_token_id, gemma.eos_token_id, gemma.pad_token_id) == (2, 1, 0)
    assert gemma.encode("hi")[0] == gemma.bos_token_id
    # This file carries no chat template (no tokenizer.chat_template key), for us as for transformers.
    assert gemma.chat_template is None and gemma_reference.chat_template is None
