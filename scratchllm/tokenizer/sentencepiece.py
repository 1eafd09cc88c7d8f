"""A SentencePiece BPE tokenizer from a GGUF file's metadata (`tokenizer.ggml.model = "llama"`).

    tokenizer.ggml.tokens      [str]    the pieces by id: "▁the" (U+2581 stands for a space), "<0x0A>"
    tokenizer.ggml.scores      [float]  the merge priority of each piece (higher first)
    tokenizer.ggml.token_type  [int]    1 normal, 2 unknown, 3 control (<bos>), 4 user-defined, 6 byte
    tokenizer.ggml.add_bos_token / add_eos_token, add_space_prefix, bos/eos/unknown/padding_token_id

What it does is what Hugging Face transformers builds from such a file (a tokenizer from a GGUF),
so that ids match that reference exactly:

encode: control tokens and user-defined tokens ("\n", "\t\t", <start_of_turn>) are matched in the
    raw text first; the rest has its spaces written as "▁" and, where the file says
    add_space_prefix (Llama 2, Mistral; not Gemma), a "▁" put before the text's first section
    unless it begins with one (the reference's Metaspace, prepend "first"; Phi-3: before every
    section, its Prepend normalizer). Then it is merged as one piece: from single characters (a
    character that is no piece becomes its UTF-8 bytes' <0xNN> pieces), joining the adjacent pair
    whose joined text is the best piece, until none joins. "Best": the merge order of the joined
    piece: the higher score first, and for the Gemma family the order of the pieces in the file
    (Gemma's scores do not follow the order its merges were learned in; the position does).
    Ties: the longer left half, then the leftmost pair (_sentencepiece.pyx). BOS per add_bos_token.
decode: pieces.py; with add_space_prefix, the prefix space comes off the text's start again.

Where the reference and llama.cpp part: llama.cpp puts the prefix "▁" before every section that
follows a special token, and before text that already begins with a space; the reference (and
this reader) only before the first section, and not before a space. Gemma's files have no prefix.

Tokens of real spaces ("  ", which Gemma files store with spaces, not "▁") are read as "▁▁", as
the reference respells them, so that text with double spaces finds them.
"""

from collections.abc import Mapping
from itertools import compress, count
from pathlib import Path
from typing import Any

import numpy as np

from scratchllm.errors import FormatError
from scratchllm.tokenizer._sentencepiece import PieceMerger
from scratchllm.tokenizer._vocabulary import TokenTexts, Vocabulary
from scratchllm.tokenizer.end_tokens import gguf_end_token_ids
from scratchllm.tokenizer.gguf_meta import fim_ids, meta_int, tokens_and_types
from scratchllm.tokenizer.pieces import SPACE, PieceDecoding, WordSplit, normalize
from scratchllm.tokenizer.spec import TokenizerSpec

GGUF_NORMAL, GGUF_UNKNOWN, GGUF_CONTROL, GGUF_USER_DEFINED, GGUF_BYTE = 1, 2, 3, 4, 6
# Architectures whose merge order is the order of the pieces in the file (the reference's Gemma builder).
ORDER_BY_POSITION = frozenset({"gemma", "gemma2", "gemma3"})
# Architectures whose prefix "▁" goes before every section (a Prepend normalizer, not Metaspace)
PREPEND_EVERY_SECTION = frozenset({"phi3"})


class SentencePieceBPE(PieceDecoding):
    """The model of a TokenizerSpec of kind "spm": encode_uncached(normalized piece) -> ids, and
    the decoding of piece texts (pieces.PieceDecoding)."""

    def __init__(self, vocab: Vocabulary, order: np.ndarray, unk_id: int | None, max_length: int,
                 strip_first_space: bool = False):
        """order: the merge order of each token as a pair's product (lower first); max_length:
        the longest token's length in characters."""
        self.vocab = vocab
        self.strip_first_space = strip_first_space
        byte_ids = [vocab.get(f"<0x{b:02X}>", -1) for b in range(256)]
        order = np.ascontiguousarray(order, dtype=np.int64)
        assert order.shape == (vocab.size,)
        self._merger = PieceMerger(vocab, order, byte_ids, -1 if unk_id is None else int(unk_id), max_length)

    def encode_uncached(self, piece: str) -> list[int]:
        return self._merger.encode(piece)


def score_order(scores: list[float]) -> np.ndarray:
    """Each token's merge order from its score: the higher first, equal scores equal (their pairs
    then go by the longer left half, as in the reference's merge list)."""
    values = np.asarray(scores, dtype=np.float64)
    _, order = np.unique(-values, return_inverse=True)  # dense rank of -score
    return order.astype(np.int64)


def _prepend(text: str) -> str:  # a Prepend("▁") and Replace(" ", "▁") normalizer: every non-empty section
    return SPACE + normalize(text) if text else text


def from_gguf_metadata(path: str | Path, meta: Mapping[str, Any]) -> TokenizerSpec:
    """The TokenizerSpec of a GGUF whose tokenizer.ggml.model is "llama"."""
    arch = str(meta.get("general.architecture", ""))
    gemma = arch in ORDER_BY_POSITION
    tokens, types = tokens_and_types(meta, path)
    n = len(tokens)
    # Tokens of nothing but whitespace with a real space in them are stored with spaces ("  ");
    # they join text as "▁" runs (the reference respells them so).
    pieces = list(tokens)
    if gemma:  # the reference's Gemma builder respells them
        for i in compress(count(), map(str.isspace, tokens)):
            if " " in tokens[i]:
                pieces[i] = SPACE * len(tokens[i])
    vocab = Vocabulary(pieces)
    # The merge order of each product: for Gemma its position in the file, the last one where a
    # text is listed twice (the one the vocabulary gives its id); for the others its score.
    if gemma:
        order = np.arange(n, dtype=np.int64)
    else:
        scores = meta.get("tokenizer.ggml.scores")
        if not isinstance(scores, list) or len(scores) != n or not set(map(type, scores)) <= {float, int}:
            raise FormatError(path, f"tokenizer.ggml.scores must be {n} numbers, one per token")
        order = score_order(scores)
    bos: Any  # the file's values, whatever they are: checked here (int() refuses what is no number)
    eos: Any
    bos, eos = meta.get("tokenizer.ggml.bos_token_id"), meta.get("tokenizer.ggml.eos_token_id")
    unk, pad = meta.get("tokenizer.ggml.unknown_token_id"), meta.get("tokenizer.ggml.padding_token_id")
    for name, value in (("bos", bos), ("eos", eos), ("unknown", unk), ("padding", pad)):
        if value is not None and not 0 <= int(value) < n:
            raise FormatError(path, f"tokenizer.ggml.{name}_token_id {value} is outside the {n} tokens")
    if unk is None and (unk_id := vocab.get("<unk>")) is not None:
        unk = unk_id
    # The prefix space (llama.cpp's default for such a vocabulary is true; Gemma's files say false)
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    model = SentencePieceBPE(vocab, order, meta_int(unk), max(map(len, pieces), default=1),
                             strip_first_space=prefix)
    # Matched whole in the raw text: control pieces (special: skip_special_tokens drops them) and
    # user-defined ones as the vocabulary spells them (a stored "  " is not: it became "▁▁").
    control = list(compress(count(), map(GGUF_CONTROL.__eq__, types)))
    named = [int(v) for v in (bos, eos, unk, pad) if v is not None]
    special = frozenset(control + named)
    added = {pieces[i]: vocab[pieces[i]] for i in sorted(special)}
    for i in compress(count(), map(GGUF_USER_DEFINED.__eq__, types)):
        if pieces[i] == tokens[i]:
            added.setdefault(pieces[i], vocab[pieces[i]])
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", True)) and bos is not None
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    return TokenizerSpec(
        kind="spm", model=model, id_to_token=TokenTexts(vocab), pre_tokenizer=WordSplit(vocab, pieces),
        normalizer=_prepend if prefix and arch in PREPEND_EVERY_SECTION else normalize,
        prefix_space="first" if prefix and arch not in PREPEND_EVERY_SECTION else "never",
        added=added, special_ids=special,
        prefix_ids=(int(bos),) if add_bos else (), suffix_ids=(int(eos),) if add_eos else (),
        bos_token_id=meta_int(bos), eos_token_id=meta_int(eos), pad_token_id=meta_int(pad),
        end_token_ids=gguf_end_token_ids(meta, added, n, path),
        chat_template=meta.get("tokenizer.chat_template"),
        model_max_length=meta_int(meta.get(f"{arch}.context_length")),
        source=str(path), fim_ids=fim_ids(meta),
    )
