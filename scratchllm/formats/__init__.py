"""Model files -> arrays, with parsers written here (GGUF, safetensors, torch zip).

`load_checkpoint(ref)` accepts `default`, `minilm`, a `.gguf` (or any shard of a split one), a
`.safetensors`, a `pytorch_model.bin`, a sharded `*.index.json` or a model folder, and returns a
`Checkpoint`: a lazy Mapping of tensor name -> np.ndarray (see checkpoint.py).
"""

from pathlib import Path

from scratchllm.formats import refs
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


def load_header(ref: str | Path) -> Checkpoint:
    """What load_checkpoint(ref) gives, for a plan made before the model loads, except for a
    package model cut into chunk packages (refs.JOINED_MODELS) not joined yet: its chunks are
    checked (installed, whole) and its metadata and tensor table read from the first chunk
    (gguf.header_checkpoint, whose tensors cannot be read), not joined; its load joins it."""
    name = str(ref)
    chunks = refs.chunks_to_join(name) if name in refs.JOINED_MODELS else []
    if not chunks:
        return load_checkpoint(ref)
    from scratchllm.formats.gguf import header_checkpoint

    model = refs.JOINED_MODELS[name]
    return header_checkpoint(chunks[0], model.size, refs.cache_dir() / model.file)
