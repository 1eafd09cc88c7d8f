"""Reading a GGUF file's tokenizer metadata (tokenizer.ggml.*), for both kinds of vocabulary it
stores: byte-level BPE (gguf_vocab.py) and SentencePiece (sentencepiece.py)."""

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from scratchllm.errors import FormatError

NORMAL = 1  # tokenizer.ggml.token_type of an ordinary token
# The keys (tokenizer.ggml.<name>_token_id) of the fill-in-the-middle tokens, by role (fim.py). The
# older prefix/suffix/middle keys (CodeLlama conversions) name the same roles; eot ends a middle.
FIM_KEYS = {"pre": ("fim_pre", "prefix"), "suf": ("fim_suf", "suffix"), "mid": ("fim_mid", "middle"),
            "pad": ("fim_pad",), "rep": ("fim_rep",), "sep": ("fim_sep",), "eot": ("eot",)}


def meta_array(meta: Mapping[str, Any], key: str, kind: type, path: str | Path) -> list[Any]:
    """The metadata array `key`, every item of type `kind`, or FormatError."""
    if key not in meta:
        raise FormatError(path, f"{key} is missing: this GGUF carries no complete tokenizer")
    values = meta[key]
    # set(map(type, ...)) runs in C: a third of the time of all(isinstance(...)) over 49k values.
    if not isinstance(values, list) or not set(map(type, values)) <= {kind}:
        raise FormatError(path, f"{key} must be an array of {'strings' if kind is str else 'integers'}")
    return values


def meta_int(v: Any) -> int | None:
    """A metadata value as an int, or None."""
    return None if v is None else int(v)


def tokens_and_types(meta: Mapping[str, Any], path: str | Path) -> tuple[list[str], list[int]]:
    """The token texts and their types (NORMAL for all when the file stores none)."""
    tokens = meta_array(meta, "tokenizer.ggml.tokens", str, path)
    types = meta_array(meta, "tokenizer.ggml.token_type", int, path) if "tokenizer.ggml.token_type" in meta \
        else [NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise FormatError(path, f"{len(tokens)} tokens but {len(types)} token types")
    return tokens, types


def fim_ids(meta: Mapping[str, Any]) -> dict[str, int]:
    """The fill-in-the-middle token ids the metadata names, by role (FIM_KEYS)."""
    out: dict[str, int] = {}
    for role, names in FIM_KEYS.items():
        value = next((v for n in names if isinstance(v := meta.get(f"tokenizer.ggml.{n}_token_id"), int)), None)
        if value is not None and value >= 0:
            out[role] = value
    return out
