"""Tokenizers written here: byte-level BPE (tokenizer.json, GGUF, tiktoken rank files) and
WordPiece (BERT), with special tokens, chat templates and streaming detokenization.

    tok = Tokenizer.from_pretrained("default")      # SmolLM2's GGUF vocabulary
    ids = tok.encode("Hello world")
    tok.decode(ids) == "Hello world"
"""

# The readers Tokenizer.from_pretrained calls, imported with the package (tokenizer.py cannot
# import them at its top: they import its TokenizerSpec), so loading a tokenizer imports nothing.
from scratchllm.tokenizer import loaders  # noqa: F401
from scratchllm.tokenizer.tokenizer import Tokenizer

__all__ = ["Tokenizer"]
