"""A tokenizer.json that SentencePiece was converted to (Llama 2, Mistral, Gemma, ...): its BPE
model with byte fallback, the "▁" space, and the decoders that undo it. loaders.py reads the rest
of the file (added tokens, post-processor, normalizers) as for any tokenizer.json.

    "model":         {"type": "BPE", "byte_fallback": true, "fuse_unk": true, "unk_token": "<unk>", ...}
    "normalizer":    Sequence[Prepend("▁"), Replace(" ", "▁")] (Llama 2, Mistral); Replace(" ", "▁") (Gemma)
    "pre_tokenizer": null, or Metaspace("▁", prepend_scheme, split) (newer Llama conversions), or
                     Split(" ", merged_with_previous) (Gemma: a no-op once spaces are "▁")
    "decoder":       Sequence[Replace("▁", " "), ByteFallback, Fuse, Strip(" ", 1, 0)], or Metaspace

The model is `tokenizers`' BPE: each character its token; a character that is no token becomes
the pieces of its UTF-8 bytes (<0xNN>, byte_fallback), or else the unknown token (a run of them
one, with fuse_unk); then the merges, the lowest rank first, ties to the leftmost pair (bpe.BPE).
The Metaspace pre-tokenizer writes spaces as "▁" (here: after the file's normalizer) and puts
one before the text (spec.prefix_space), and with split=true cuts the text before each "▁".
Unigram models (T5, ALBERT: Viterbi over piece scores, usually behind a precompiled
normalizer) are not read here: refused by name.
"""

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scratchllm.errors import FormatError
from scratchllm.tokenizer import pretokenize as pt
from scratchllm.tokenizer.bpe import BPE
from scratchllm.tokenizer.pieces import SPACE, PieceDecoding, WordSplit, byte_pieces, normalize

Json = Any  # a node of the parsed tokenizer.json (loaders.py reports a wrong shape as malformed)


class PieceMergesBPE(PieceDecoding):
    """A TokenizerSpec model of kind "spm" from a tokenizer.json: encode_uncached(piece) -> ids
    by the file's merges; decoding as pieces.PieceDecoding."""

    def __init__(self, vocab: dict[str, int], merges: list[tuple[str, str]], *, unk_id: int | None,
                 byte_fallback: bool, fuse_unk: bool, ignore_merges: bool, strip_first_space: bool) -> None:
        self.vocab = vocab
        self._bpe = BPE.from_merges(vocab, merges, ignore_merges=ignore_merges)
        self._byte_ids = [vocab.get(p) for p in byte_pieces()] if byte_fallback else None
        self.unk_id, self.fuse_unk, self.ignore_merges = unk_id, fuse_unk, ignore_merges
        self.strip_first_space = strip_first_space

    def encode_uncached(self, piece: str) -> list[int]:
        vocab = self.vocab
        if self.ignore_merges and piece in vocab:
            return [vocab[piece]]
        get, byte_ids, unk = vocab.get, self._byte_ids, self.unk_id
        symbols: list[int] = []
        unknown_run = False  # the last symbol stands for unknown characters (fuse_unk joins the next)
        for ch in piece:
            i = get(ch)
            if i is None and byte_ids is not None:
                ids = [byte_ids[b] for b in ch.encode("utf-8")]
                if None not in ids:
                    symbols += ids  # type: ignore[arg-type]  # None is not in ids
                    unknown_run = False
                    continue
            if i is None:
                if unk is None or (self.fuse_unk and unknown_run):
                    continue  # dropped without an unknown token (as tokenizers does), or fused
                i, unknown_run = unk, True
            else:
                unknown_run = False
            symbols.append(i)
        return self._bpe.merge(symbols)


@dataclass(frozen=True)
class PiecePipeline:
    """What the SentencePiece parts of a tokenizer.json make of its text, for TokenizerSpec."""

    model: PieceMergesBPE
    normalizer: Callable[[str], str]
    pre_tokenizer: Callable[[str], list[str]]
    prefix_space: str  # TokenizerSpec.prefix_space


def is_piece_decoder(node: Json) -> bool:
    """Whether the decoder turns "▁" back into spaces (a SentencePiece-converted file)."""
    steps = node.get("decoders", []) if node and node.get("type") == "Sequence" else [node] if node else []
    return any(d.get("type") == "Metaspace" or (d.get("type") == "Replace" and d.get("content") == " ")
               for d in steps)


def read(spec: Json, path: Path, vocab: dict[str, int], merges: list[tuple[str, str]],
         normalizer: Callable[[str], str] | None) -> PiecePipeline:
    """The model, normalizer and pre-tokenizer of a SentencePiece-converted tokenizer.json;
    `normalizer`: the file's own (loaders._normalizer)."""
    m = spec["model"]
    for key in ("continuing_subword_prefix", "end_of_word_suffix", "dropout"):
        if m.get(key):
            raise FormatError(path, f"a SentencePiece BPE with {key} {m[key]!r} is not supported")
    byte_fallback = bool(m.get("byte_fallback", False))
    strip = _decoder(spec.get("decoder"), byte_fallback, path)
    prefix, splits = _pre_tokenizer(spec.get("pre_tokenizer"), path)
    unk = m.get("unk_token")
    if unk is not None and unk not in vocab:
        raise FormatError(path, f"unk_token {unk!r} is not in the vocab")
    model = PieceMergesBPE(vocab, merges, unk_id=vocab[unk] if unk is not None else None,
                           byte_fallback=byte_fallback, fuse_unk=bool(m.get("fuse_unk", False)),
                           ignore_merges=bool(m.get("ignore_merges", False)), strip_first_space=strip)
    words = WordSplit(vocab, list(vocab))
    split = pt.PreTokenizer(splits)

    def pre_tokenize(text: str) -> list[str]:
        return [word for piece in split(text) for word in words(piece)]

    def spaces(text: str) -> str:  # the file's normalizer, then Metaspace's "▁" for " "
        return normalize(normalizer(text) if normalizer is not None else text)

    return PiecePipeline(model, spaces if prefix is not None else normalizer or _same, pre_tokenize,
                         prefix or "never")


def _same(text: str) -> str:
    return text


def _decoder(node: Json, byte_fallback: bool, path: Path) -> bool:
    """Check the decoder is SentencePiece's; whether it strips the prefix space at the start."""
    steps = node["decoders"] if node and node.get("type") == "Sequence" else [node] if node else []
    strip, bytes_decoded = False, False
    for d in steps:
        kind = d.get("type")
        if kind == "Replace" and d.get("pattern") == {"String": SPACE} and d.get("content") == " ":
            continue
        if kind == "ByteFallback":
            bytes_decoded = True
        elif kind == "Fuse":
            continue
        elif kind == "Strip" and d.get("content") == " " and d.get("stop", 0) == 0 and d.get("start", 0) in (0, 1):
            strip = d.get("start", 0) == 1
        elif kind == "Metaspace" and d.get("replacement", SPACE) == SPACE:
            strip = _prepend_scheme(d) != "never"
        else:
            raise FormatError(path, f"decoder {kind!r} ({d}) is not one a SentencePiece tokenizer.json uses")
    if byte_fallback and not bytes_decoded:
        raise FormatError(path, "the model falls back to byte pieces but the decoder has no ByteFallback")
    return strip


def _prepend_scheme(node: Json) -> str:
    # tokenizers >= 0.14 writes prepend_scheme; older files add_prefix_space (true: "always")
    scheme = node.get("prepend_scheme", "always" if node.get("add_prefix_space", True) else "never")
    if scheme not in ("first", "always", "never"):
        raise ValueError(f"Metaspace prepend_scheme {scheme!r}")
    return str(scheme)


def _pre_tokenizer(node: Json, path: Path) -> tuple[str | None, list[pt.Split]]:
    """(Metaspace's prepend scheme, or None without a Metaspace; the splits before the model)."""
    if node is None:
        return None, []
    kind = node.get("type")
    if kind == "Metaspace":
        if node.get("replacement", SPACE) != SPACE:
            raise FormatError(path, f"Metaspace replacement {node.get('replacement')!r} is not '{SPACE}'")
        # older files split always (they have no `split`)
        return _prepend_scheme(node), [pt.Split(SPACE, "merged_with_next")] if node.get("split", True) else []
    if kind == "Split":
        pattern = node["pattern"]
        source = pattern["Regex"] if "Regex" in pattern else pt.escape(pattern["String"])
        behavior = {"Isolated": "isolated", "Removed": "removed", "MergedWithPrevious": "merged_with_previous",
                    "MergedWithNext": "merged_with_next"}.get(node.get("behavior"))
        if behavior is None or node.get("invert"):
            raise FormatError(path, f"Split behavior {node.get('behavior')!r} (invert {node.get('invert')}) "
                                    "is not supported here")
        return None, [pt.Split(source, behavior)]
    raise FormatError(path, f"pre-tokenizer {kind!r} is not supported with a SentencePiece model")
