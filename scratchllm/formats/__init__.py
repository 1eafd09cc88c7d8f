"""Model files -> arrays, with parsers written here (GGUF, safetensors, torch zip).

`load_checkpoint(ref)` accepts `default`, `minilm`, a `.gguf` (or any shard of a split one), a
`.safetensors`, a `pytorch_model.bin`, a sharded `*.index.json` or a model folder, and returns a
`Checkpoint`: a lazy Mapping of tensor name -> np.ndarray (see checkpoint.py).
"""

from pathlib import Path

from scratchllm.formats.checkpoint import Checkpoint, TensorInfo
from scratchllm.formats.files import load_file, sniff
from scratchllm.formats.refs import resolve_model

__all__ = ["Checkpoint", "TensorInfo", "load_checkpoint", "sniff"]


def load_checkpoint(ref: str | Path) -> Checkpoint:
    """Open a checkpoint lazily: only its table of contents is read here."""
    path = resolve_model(ref)
    if path.is_dir():
        from scratchllm.formats.folder import load_folder

        return load_folder(path)
    if sniff(path) == "index":
        from scratchllm.formats.folder import load_index

        return load_index(path)
    return load_file(path)
