"""A byte-level BPE tokenizer from a GGUF file's metadata (`tokenizer.ggml.*`), as llama.cpp reads it.

    tokenizer.ggml.model       "gpt2" (byte-level BPE; the only kind read here)
    tokenizer.ggml.tokens      [str]  token text by id, in GPT-2's byte-level alphabet
    tokenizer.ggml.token_type  [int]  1 normal, 3 control (<|im_start|>), 4 user-defined, ...
    tokenizer.ggml.merges      [str]  "left right", rank = position in the list
    tokenizer.ggml.pre         str    the pre-tokenizer's name (pretokenize.from_gguf_name)

Cost: building the tables is a large part of loading a small model (49152 tokens and 48900
merges for SmolLM2), so each is made in one pass in C, into C arrays rather than Python objects:
the vocabulary by _vocabulary.pyx, the merge table over token ids by _merge_ranks.pyx. What each
holds in memory: docs/tokenizer-memory.md.
"""

from collections.abc import Mapping
from itertools import compress, count
from pathlib import Path
from typing import Any

from scratchllm.errors import FormatError
from scratchllm.tokenizer import _merge_ranks
from scratchllm.tokenizer import pretokenize as pt
from scratchllm.tokenizer._vocabulary import TokenTexts, Vocabulary
from scratchllm.tokenizer.bpe import BPE
from scratchllm.tokenizer.end_tokens import gguf_end_token_ids
from scratchllm.tokenizer.gguf_meta import fim_ids, meta_int, tokens_and_types
from scratchllm.tokenizer.spec import TokenizerSpec

# GGUF token types (llama.cpp's llama_token_type): 1 = normal, 3 = control (<|im_start|>),
# 4 = user-defined.
GGUF_NORMAL, GGUF_CONTROL, GGUF_USER_DEFINED = 1, 3, 4


def from_gguf(path: str | Path, metadata: Mapping[str, Any] | None = None) -> TokenizerSpec:
    """The tokenizer of the GGUF file at `path`. `metadata`: the file's metadata when the caller
    has parsed it already (LLM opens a GGUF once for the model and its tokenizer)."""
    if metadata is None:
        from scratchllm.formats.gguf import GGUFFile

        metadata = GGUFFile(path).metadata
    meta = metadata
    kind = meta.get("tokenizer.ggml.model")
    if kind == "llama":  # SentencePiece
        from scratchllm.tokenizer.sentencepiece import from_gguf_metadata

        return from_gguf_metadata(path, meta)
    if kind != "gpt2":
        raise FormatError(path, f"tokenizer.ggml.model is {kind!r}; we read byte-level BPE ('gpt2') and "
                                "SentencePiece ('llama') only")
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
        if key not in meta:
            raise FormatError(path, f"{key} is missing: this GGUF carries no complete BPE tokenizer")
    tokens, types = tokens_and_types(meta, path)
    # A token listed twice keeps its last id (as dict(zip(...)) would).
    vocab = Vocabulary(tokens)
    table = merge_table(meta["tokenizer.ggml.merges"], path, vocab)
    # The file's own declaration decides (llama.cpp reads it too). transformers' GGUF loader ignores
    # it and applies GPT-2's rule, which differs for 'smollm' where digits follow spaces or letters.
    pre = str(meta.get("tokenizer.ggml.pre", "default"))
    # Control and user-defined tokens are matched in raw text before BPE (llama.cpp does the same);
    # control tokens are the "special" ones that decode(skip_special_tokens=True) drops.
    # The few ids that are no plain token are found in C (compress over map): a Python loop over
    # all 49152 types took 3.5 ms.
    odd = list(compress(count(), map(GGUF_NORMAL.__ne__, types)))
    added = {tokens[i]: i for i in odd if types[i] == GGUF_CONTROL or types[i] == GGUF_USER_DEFINED}
    special = frozenset(i for i in odd if types[i] == GGUF_CONTROL)
    bos: Any  # the file's values, whatever they are (int() refuses what is no number)
    eos: Any
    bos, eos = meta.get("tokenizer.ggml.bos_token_id"), meta.get("tokenizer.ggml.eos_token_id")
    # Without the key, llama.cpp adds BOS for the Llama 3 family only.
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", pre in pt.GGUF_ADD_BOS)) and bos is not None
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    # The vocabulary gives each text one id, and distinct texts distinct ids: what the id table needs.
    model = BPE(vocab, table, len(tokens), ignore_merges=pre in pt.GGUF_IGNORE_MERGES)
    return TokenizerSpec(
        # The texts by id from the compact vocabulary: the metadata's 49152 str objects (4 MiB)
        # are not kept.
        kind="bpe", model=model, id_to_token=TokenTexts(vocab), pre_tokenizer=pt.from_gguf_name(pre, path),
        added=added, special_ids=special,
        prefix_ids=(int(bos),) if add_bos else (), suffix_ids=(int(eos),) if add_eos else (),
        bos_token_id=meta_int(bos), eos_token_id=meta_int(eos),
        end_token_ids=gguf_end_token_ids(meta, added, len(tokens), path),
        pad_token_id=meta_int(meta.get("tokenizer.ggml.padding_token_id")),
        chat_template=meta.get("tokenizer.chat_template"),
        model_max_length=meta_int(meta.get(f"{meta.get('general.architecture')}.context_length")),
        source=str(path), fim_ids=fim_ids(meta),
    )


def merge_table(merges: list[str], path: str | Path, vocab: Vocabulary
                ) -> tuple[_merge_ranks.PairTable, dict[str, int]]:
    """'left right' lines -> BPE's id table (PairTable, extra), cut as llama.cpp cuts: at the
    first space after the first character; a pair listed twice keeps its first (best) rank. See
    _merge_ranks.pyx."""
    try:  # the C loop checks each line's type: no separate pass over the 48900 lines
        table, bad = _merge_ranks.table_from_lines(merges, vocab)
    except TypeError:
        raise FormatError(path, "tokenizer.ggml.merges must be an array of strings") from None
    if table is None:
        raise FormatError(path, f"merge {merges[bad]!r} has no space between its two halves")
    return table
