"""One model file -> a Checkpoint, by its format: GGUF, safetensors or a torch zip.

`sniff(path)` names the format (the suffix when it names one, else the first bytes);
`load_file(path)` opens the file with its reader. Folders and sharded indexes (folder.py) open
their files through here, and `load_checkpoint` (the package's entry point) too.
"""

from pathlib import Path

from scratchllm.errors import FormatError
from scratchllm.formats.checkpoint import Checkpoint


def sniff(path: Path) -> str:
    """The format of a file: its suffix when it names one (so that a bad .gguf is reported as a bad
    GGUF), else its first bytes."""
    by_suffix = {".gguf": "gguf", ".safetensors": "safetensors"}
    if path.suffix in by_suffix:
        return by_suffix[path.suffix]
    if path.name.endswith(".index.json"):
        return "index"
    try:
        with open(path, "rb") as f:
            head = f.read(9)
    except OSError as err:
        raise FormatError(path, f"cannot read: {err.strerror or err}") from None
    if head[:4] == b"GGUF":
        return "gguf"
    if head[:4] == b"PK\x03\x04":
        return "torch"
    if head[:1] == b"\x80":
        return "torch-legacy"
    if len(head) == 9 and head[8:9] == b"{" and int.from_bytes(head[:8], "little") < 2**32:
        return "safetensors"  # an 8-byte little-endian header length, then the JSON header
    raise FormatError(path, f"unknown model file format (first bytes {head.hex()})")


def is_gguf(path: Path) -> bool:
    """Whether a file is GGUF by its name or its first bytes (Ollama's blobs have no suffix)."""
    if path.suffix == ".gguf":
        return True
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def load_file(path: Path) -> Checkpoint:
    """Open one weights file lazily: only its table of contents is read here."""
    kind = sniff(path)
    if kind == "gguf":
        from scratchllm.formats.gguf_split import load_gguf

        return load_gguf(path)  # one file, or every shard of a split model
    if kind == "safetensors":
        from scratchllm.formats.safetensors import load_safetensors

        return load_safetensors(path)
    if kind == "torch":
        from scratchllm.formats.torchzip import load_torch

        return load_torch(path)
    if kind == "index":
        raise FormatError(path, "a sharded checkpoint's index where one weights file was expected")
    raise FormatError(path, "a legacy (pre-1.6, non-zip) torch.save file; re-save it with a recent torch")
