"""Model folders and sharded checkpoints (`*.index.json`), the way Hugging Face lays them out.

A folder holds one of, in this order of preference (safetensors first, as transformers does):
    model.safetensors | model.safetensors.index.json | pytorch_model.bin | pytorch_model.bin.index.json
    | exactly one *.gguf (a split GGUF counts as one: its first shard)
An index is {"metadata": {...}, "weight_map": {tensor name: shard file name}}; the shards are
opened lazily like any single file and merged into one Checkpoint.
"""

import json
from pathlib import Path

from scratchllm.errors import FormatError
from scratchllm.formats.checkpoint import Checkpoint, merge
from scratchllm.formats.files import load_file
from scratchllm.formats.gguf_split import first_shard

PREFERENCE = [
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
]


def load_folder(folder: Path) -> Checkpoint:
    for name in PREFERENCE:
        if (folder / name).is_file():
            ckpt = load_index(folder / name) if name.endswith(".index.json") else load_file(folder / name)
            ckpt.path = str(folder)
            return ckpt
    ggufs = sorted(p for p in folder.glob("*.gguf") if first_shard(p) == p)  # a split model: its first shard
    if len(ggufs) == 1:
        return load_file(ggufs[0])
    found = ", ".join(sorted(p.name for p in folder.iterdir())[:12]) or "nothing"
    raise FormatError(folder, f"no model weights here: expected one of {', '.join(PREFERENCE)} "
                              f"or a single .gguf; found {found}")


def load_index(index_path: Path) -> Checkpoint:
    try:
        index = json.loads(index_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise FormatError(index_path, f"not a readable JSON index: {err}") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise FormatError(index_path, "index has no 'weight_map' object of tensor name -> shard file")
    shard_names = sorted(set(weight_map.values()))
    parts = []
    for shard in shard_names:
        shard_path = index_path.parent / shard
        # A shard name is a file beside the index, never a path that escapes the folder.
        if Path(shard).name != shard or not shard_path.is_file():
            raise FormatError(index_path, f"shard '{shard}' is missing or not a file in {index_path.parent}")
        parts.append(load_file(shard_path))
    ckpt = merge(str(index_path), parts, container={
        "kind": "index",
        "shards": [{"file": s, "tensors": len(p), "container": p.container}
                   for s, p in zip(shard_names, parts, strict=True)],
        "metadata": index.get("metadata", {}),
    })
    for name, shard in weight_map.items():
        info = ckpt.infos.get(name)
        if info is None or Path(info.file).name != shard:
            raise FormatError(index_path, f"weight_map puts '{name}' in {shard}, but that shard does not hold it")
    return ckpt
