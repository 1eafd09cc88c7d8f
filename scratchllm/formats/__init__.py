"""Model files -> arrays, with parsers written here (GGUF, safetensors, torch zip).

`load_checkpoint(ref)` accepts `default`, `minilm`, a `.gguf`, a `.safetensors`, a
`pytorch_model.bin`, a sharded `*.index.json` or a model folder, and returns a `Checkpoint`:
a lazy Mapping of tensor name -> np.ndarray (see checkpoint.py).
"""

from pathlib import Path

from scratchllm.errors import FormatError
from scratchllm.formats.checkpoint import Checkpoint, TensorInfo
from scratchllm.formats.refs import resolve_model

__all__ = ["Checkpoint", "TensorInfo", "load_checkpoint", "sniff"]


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


def load_checkpoint(ref) -> Checkpoint:
    """Open a checkpoint lazily: only its table of contents is read here."""
    path = resolve_model(ref)
    if path.is_dir():
        from scratchllm.formats.folder import load_folder

        return load_folder(path)
    kind = sniff(path)
    if kind == "gguf":
        from scratchllm.formats.gguf import load_gguf

        return load_gguf(path)
    if kind == "safetensors":
        from scratchllm.formats.safetensors import load_safetensors

        return load_safetensors(path)
    if kind == "index":
        from scratchllm.formats.folder import load_index

        return load_index(path)
    if kind == "torch":
        from scratchllm.formats.torchzip import load_torch

        return load_torch(path)
    raise FormatError(path, "a legacy (pre-1.6, non-zip) torch.save file; re-save it with a recent torch")
