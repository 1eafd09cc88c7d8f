"""scratchllm: an LLM inference system built from first principles.

The public surface is small and locked (tests/test_public_api.py):
``LLM``, ``SamplingParams``, ``Tokenizer``, ``load_checkpoint``, ``FormatError``.
Heavy modules are imported on first use so that ``import scratchllm`` stays cheap.
"""

from scratchllm.errors import FormatError

__version__ = "0.2.0.dev0"

__all__ = ["LLM", "SamplingParams", "Tokenizer", "load_checkpoint", "FormatError", "__version__"]

_LAZY = {
    "LLM": "scratchllm.llm",
    "SamplingParams": "scratchllm.sampling",
    "Tokenizer": "scratchllm.tokenizer",
    "load_checkpoint": "scratchllm.formats",
}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'scratchllm' has no attribute {name!r}")
