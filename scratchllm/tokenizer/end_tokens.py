"""The tokens that end generation: every id at which a model's output is over, not only its EOS.

A model names one end-of-sequence id, but writes others where its text ends: Qwen2.5 ends a
chat turn with <|im_end|> (its EOS) and a document with <|endoftext|>; Llama 3 ends a turn with
<|eot_id|>, a tool call with <|eom_id|>; Gemma a turn with <end_of_turn>. The engines stop on
any of them (unless a request sets ignore_eos).

Where the set comes from:
  a GGUF file        tokenizer.ggml.eos_token_id, eot_token_id (end of turn) and eom_token_id
                     (end of message), and every token the file types as control or user-defined
                     whose text is one of END_TEXTS (an ordinary token spelled so is text the
                     model wrote, not an end). llama.cpp decides "end of generation" from the same
                     keys and texts when it loads a vocabulary, fill-in-the-middle's pad, repo and
                     file separator tokens included (docs/references.md).
  a Hugging Face     generation_config.json's eos_token_id, an int or a list (transformers'
  folder             generate and vLLM stop on each), with the tokenizer's own EOS.
"""

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from scratchllm.errors import FormatError

logger = logging.getLogger(__name__)

# The texts of end tokens, by the models that write them.
END_TEXTS = frozenset({
    "<|endoftext|>",  # GPT-2, Qwen, SmolLM: the end of a document
    "<|im_end|>",  # ChatML (Qwen, SmolLM): the end of a turn
    "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>",  # Llama 3: turn, message (tool call), text
    "<end_of_turn>",  # Gemma
    "<|end|>",  # Phi-3
    "<EOT>", "_<EOT>",  # Code Llama's infilling
    "<|return|>", "<|call|>",  # gpt-oss's harmony format
    "<end_of_utterance>",  # SmolDocling
    "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",  # fill-in-the-middle (Qwen2.5-Coder): past the middle
})
# The GGUF metadata keys that name an end token by id.
END_ID_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id",
               "tokenizer.ggml.fim_pad_token_id", "tokenizer.ggml.fim_rep_token_id", "tokenizer.ggml.fim_sep_token_id")


def gguf_end_token_ids(meta: Mapping[str, Any], marked: Mapping[str, int], vocab_size: int,
                       path: str | Path) -> frozenset[int]:
    """The end tokens of a GGUF file's vocabulary (see the module doc). `marked`: text -> id of
    the tokens the file types as control or user-defined (the loaders' added tokens). A key whose
    id is no token of the vocabulary is left out with a warning, as llama.cpp leaves it out."""
    ids = {marked[text] for text in END_TEXTS if text in marked}
    for key in END_ID_KEYS:
        value = meta.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < vocab_size:
            logger.warning("%s: %s %r is not a token id in [0, %d); it ends nothing", path, key, value, vocab_size)
            continue
        ids.add(value)
    return frozenset(ids)


def generation_config_end_ids(folder: Path, vocab_size: int) -> frozenset[int]:
    """generation_config.json's eos_token_id (an int or a list of ints) in a model folder; none
    when the folder has no such file."""
    path = folder / "generation_config.json"
    if not path.is_file():
        return frozenset()
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise FormatError(path, f"cannot be read as JSON: {err}") from None
    value = config.get("eos_token_id") if isinstance(config, dict) else None
    values = value if isinstance(value, list) else [] if value is None else [value]
    bad = [v for v in values if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < vocab_size]
    if bad:
        raise FormatError(path, f"eos_token_id {bad[0]!r} is not a token id in [0, {vocab_size})")
    return frozenset(values)
