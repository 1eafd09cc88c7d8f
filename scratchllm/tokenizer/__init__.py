"""Tokenizers written here: byte-level BPE (tokenizer.json, GGUF, tiktoken rank files) and
WordPiece (BERT), with special tokens, chat templates and streaming detokenization.

    tok = Tokenizer.from_pretrained("default")      # SmolLM2's GGUF vocabulary
    ids = tok.encode("Hello world")
    tok.decode(ids) == "Hello world"
"""

from scratchllm.tokenizer.tokenizer import Tokenizer

__all__ = ["Tokenizer"]
