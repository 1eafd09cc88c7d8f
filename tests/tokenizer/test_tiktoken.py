"""tiktoken rank files, against tiktoken itself, offline.

tiktoken.get_encoding("gpt2") downloads GPT-2's ranks, and nothing is downloaded here. So the
test writes a rank file of its own: GPT-2's rule (GPT-2's regex, tiktoken's merge-by-rank over
bytes, the 256 single bytes first in GPT-2's order) with a different rank table, derived from
SmolLM2's byte-level vocabulary and merges (a merge's rank = 256 + its line). The algorithm under
test is the same one GPT-2's real file would exercise; only the table differs.
"""

import base64

import pytest

from scratchllm import Tokenizer
from scratchllm.errors import FormatError
from scratchllm.tokenizer.bytelevel import BYTE_TO_CHAR, CHAR_TO_BYTE

tiktoken = pytest.importorskip("tiktoken")
from tiktoken.load import load_tiktoken_bpe  # noqa: E402

# tiktoken's own spelling of GPT-2's pattern (ours is written differently; both must agree).
TIKTOKEN_GPT2_PAT = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


@pytest.fixture(scope="module")
def rank_file(tmp_path_factory, smollm_vocab):
    _, _, merges = smollm_vocab

    def to_bytes(token):
        return bytes(CHAR_TO_BYTE[c] for c in token)

    # GPT-2's order for the single bytes: the printable ones first (their own characters), then
    # the shifted ones, i.e. the order of their stand-in characters.
    ranks = {bytes([b]): r for r, b in enumerate(sorted(range(256), key=lambda b: ord(BYTE_TO_CHAR[b])))}
    for merge in merges:
        left, right = merge.split(" ", 1)
        ranks.setdefault(to_bytes(left) + to_bytes(right), len(ranks))
    path = tmp_path_factory.mktemp("tiktoken") / "smollm2-gpt2-rule.tiktoken"
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()))
    return path


@pytest.fixture(scope="module")
def reference(rank_file):
    ranks = load_tiktoken_bpe(str(rank_file))  # also proves the file is in tiktoken's format
    return tiktoken.Encoding(name="gpt2-rule-smollm2-ranks", pat_str=TIKTOKEN_GPT2_PAT,
                             mergeable_ranks=ranks, special_tokens={"<|endoftext|>": len(ranks)})


@pytest.fixture(scope="module")
def ours(rank_file):
    return Tokenizer.from_pretrained(rank_file)


def test_ids_equal_tiktoken_on_corpus(ours, reference, all_docs, same_ids):
    def ref(text):
        return reference.encode(text, allowed_special="all")

    assert same_ids(ours.encode, ref, all_docs) > 20_000


def test_round_trip_and_decode(ours, reference, all_docs):
    for _, text in all_docs:
        ids = ours.encode(text)
        assert ours.decode(ids) == text == reference.decode(ids)


def test_endoftext_is_the_id_after_the_ranks(ours, reference):
    assert ours.eos_token_id == reference.eot_token == ours.vocab_size - 1
    ids = ours.encode("a<|endoftext|>b")
    assert ids == reference.encode("a<|endoftext|>b", allowed_special="all") and ours.eos_token_id in ids


def test_bad_rank_files_are_refused(tmp_path):
    bad = tmp_path / "bad.tiktoken"
    bad.write_text("not base64 at all\n")
    with pytest.raises(FormatError, match="line 1"):
        Tokenizer.from_pretrained(bad)
    partial = tmp_path / "partial.tiktoken"
    partial.write_text("".join(f"{base64.b64encode(bytes([b])).decode()} {b}\n" for b in range(200)))
    with pytest.raises(FormatError, match="single bytes"):
        Tokenizer.from_pretrained(partial)


def test_whole_piece_in_ranks_wins_over_merging(tmp_path):
    """tiktoken takes a piece that is itself a token as that token, even where merging would
    stop short of it: with ranks bc < ab < cd < abcd, merging 'abcd' ends at a|bc|d."""
    ranks = {bytes([b]): b for b in range(256)}
    for extra in (b"bc", b"ab", b"cd", b"abcd"):
        ranks[extra] = len(ranks)
    path = tmp_path / "tiny.tiktoken"
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()))
    ref = tiktoken.Encoding(name="tiny", pat_str=TIKTOKEN_GPT2_PAT, mergeable_ranks=ranks, special_tokens={})
    ours = Tokenizer.from_pretrained(path, special_tokens={})
    for text in ("abcd", "abcdabcd", "xabcd abcd", "abc"):
        assert ours.encode(text) == ref.encode(text), text
    assert ours.encode("abcd") == [ranks[b"abcd"]]
    assert ours.encode("abcdx") == [ranks[b"a"], ranks[b"bc"], ranks[b"d"], ranks[b"x"]]
