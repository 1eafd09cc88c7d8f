"""`scratchllm inspect PATH|default|minilm`: a model file opened up, byte by byte.

Prints the first 64 bytes (hex + ASCII), the container's structure (GGUF header and metadata,
safetensors JSON header, or zip entries and what the pickle asks for), the tokens that end
generation (a GGUF's or a model folder's tokenizer), the tensor table, totals, and the planned
memory layout: every tensor packed into one 4 KiB-page-aligned arena, drawn as
address ranges with each tensor's start, size and padding. `--json` prints the same as one JSON
object.

The totals say what loading the file as a model takes: the memory plan's weight figure at the
dtype `auto` picks (engine/shared_memory_plan.estimated_weights_bytes: what `serve` plans with,
within 5% of what the loader holds), beside the arena of every tensor dequantized to float32
that the layout draws (what `formats.arena.load_arena` makes, not what a model keeps).
"""

import argparse
import json
from pathlib import Path
from typing import Any

from scratchllm.cli import Subparsers
from scratchllm.errors import FormatError, ScratchLLMError
from scratchllm.formats.describe import describe
from scratchllm.formats.files import is_gguf
from scratchllm.formats.refs import resolve_model

ARENA_BASE = 0x10000000  # the design article's drawing starts its arena here; offsets are what matter


def add_parser(sub: Subparsers) -> None:
    p = sub.add_parser("inspect", help="show what is inside a model file", description=__doc__)
    p.add_argument("model", help="a .gguf (or a split model's shard), .safetensors, pytorch_model.bin, "
                                 "*.index.json, a model folder, 'default' or 'minilm'")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument("--limit", type=int, default=0, metavar="N",
                   help="show only the first N tensors in the table and the layout (0 = all)")
    p.add_argument("--tensor-align", type=int, default=64, choices=[64, 256, 4096],
                   help="alignment of each tensor inside the arena (4096: every tensor on its own pages)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    report = describe(args.model, tensor_align=args.tensor_align)
    report["end_tokens"] = end_tokens(args.model)
    report["totals"] |= model_weights(args.model)
    if args.json:
        print(json.dumps(report, default=str))
    else:
        print(render(report, limit=args.limit))
    return 0


def end_tokens(model: str | Path) -> list[dict[str, Any]] | None:
    """The tokens that end generation (tokenizer/end_tokens.py), each with its text and whether it
    is the EOS; None where the file carries no tokenizer (a GGUF without one, a weights-only file)."""
    from scratchllm.tokenizer import Tokenizer

    path = resolve_model(model)
    if not (path.is_dir() or is_gguf(path)):
        return None
    try:
        tok = Tokenizer.from_pretrained(path)
    except FormatError:
        return None
    return [{"id": i, "text": tok.id_to_token(i), "eos": i == tok.eos_token_id} for i in sorted(tok.end_token_ids)]


def render_end_tokens(tokens: list[dict[str, Any]] | None) -> list[str]:
    if tokens is None:
        return ["  (no tokenizer in this file)"]
    if not tokens:
        return ["  none: this tokenizer names no end of generation"]
    return [f"  {t['id']:>8}  {t['text']}{'  (the EOS)' if t['eos'] else ''}" for t in tokens]


def model_weights(ref: str) -> dict[str, Any]:
    """{"model_dtype", "model_bytes"}: the dtype a load picks and the memory plan's weight figure
    for it; {} for a file that is not a model we run (no config, another architecture)."""
    from scratchllm.engine.shared_memory_plan import estimated_weights_bytes
    from scratchllm.formats import load_header
    from scratchllm.models.loader import auto_dtype, read_config

    try:
        ckpt = load_header(ref)
        dtype = auto_dtype(ckpt, read_config(Path(ckpt.path), ckpt))
    except ScratchLLMError:
        return {}
    return {"model_dtype": dtype, "model_bytes": estimated_weights_bytes(ckpt, dtype)}


def mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB"


def hexdump(data: bytes, width: int = 16) -> list[str]:
    lines: list[str] = []
    for start in range(0, len(data), width):
        chunk = data[start:start + width]
        hexes = " ".join(f"{b:02x}" for b in chunk[:8]) + "  " + " ".join(f"{b:02x}" for b in chunk[8:])
        text = "".join(chr(b) if 32 <= b < 127 else "." for b in chunk)
        lines.append(f"{start:08x}  {hexes:<49} |{text}|")
    return lines


def render_value(value: Any) -> str:
    if isinstance(value, dict) and "count" in value:
        first = ", ".join(repr(v) for v in value["first"])
        last = ", ".join(repr(v) for v in value["last"])
        return f"{value['count']} items: [{first}, ..., {last}]"
    if isinstance(value, dict) and "chars" in value:
        return f"{value['chars']} chars: {value['start']!r}..."
    return repr(value)


def render_container(r: dict[str, Any]) -> list[str]:
    c, out = r["container"], list[str]()
    kind = c.get("kind")
    if kind == "gguf":
        out.append(f"GGUF v{c['version']}: {c['tensor_count']} tensors, {c['metadata_count']} metadata keys, "
                   f"alignment {c['alignment']}, tensor data from byte {c['data_offset']:,}")
        if "shards" in c:  # a split model (formats/gguf_split.py): the header above is its first shard's
            out.append(f"split into {len(c['shards'])} shards (the metadata below is the first's):")
            for shard in c["shards"]:
                out.append(f"  {shard['file']}: {shard['tensors']} tensors, {shard['file_size']:,} bytes, "
                           f"tensor data from byte {shard['data_offset']:,}")
        types = c["metadata_types"]
        for key, value in r["metadata"].items():
            out.append(f"  {key:<42} {types.get(key, ''):<14} {render_value(value)}")
    elif kind == "safetensors":
        out.append(f"safetensors: 8-byte header length = {c['header_length']:,}, JSON header of "
                   f"{c['header_entries']} entries, tensor data from byte {c['data_offset']:,}")
        out.append(f"  __metadata__: {json.dumps(r['metadata'])}")
        for name, entry in c["header_first"].items():
            if name != "__metadata__":
                out.append(f"  {json.dumps(name)}: {json.dumps(entry)}")
        if c["header_entries"] > len(c["header_first"]):
            out.append(f"  ... {c['header_entries'] - len(c['header_first'])} more entries")
    elif kind == "zip":
        out.append(f"zip archive '{c['archive']}', byteorder {c['byteorder']}, {len(c['entries'])} entries "
                   f"(local header offset -> data offset, size):")
        for e in c["entries"]:
            note = "" if e["stored"] else "  (compressed)"
            out.append(f"  {e['name']:<44} {e['header_offset']:>12,} -> {e['data_offset']:>12,}  "
                       f"{e['size']:>12,} B{note}")
        pk = c["pickle"]
        out.append(f"data.pkl: pickle protocol {pk['protocol']}, {pk['bytes']:,} bytes, {pk['opcodes']} opcodes, "
                   f"{pk['BINPERSID']} persistent ids (storages), {pk['REDUCE']} REDUCE calls; globals named:")
        for name, count in pk["globals"].items():
            out.append(f"  {name}  (x{count})")
        out.append(f"storages: {len(c['storages'])}, each one whole zip entry data/<key> (no chunks, "
                   f"no length headers)")
    elif kind == "index":
        out.append(f"sharded checkpoint: {len(c['shards'])} shards")
        for shard in c["shards"]:
            out.append(f"  {shard['file']}: {shard['tensors']} tensors")
    return out


def render_table(tensors: list[dict[str, Any]]) -> list[str]:
    rows = [("name", "dtype", "shape", "strides", "offset", "bytes", "contig", "quantization")]
    for t in tensors:
        rows.append((t["name"], t["dtype"], "x".join(map(str, t["shape"])) or "()",
                     ",".join(map(str, t["strides"])) or "()", f"{t['offset']:,}", f"{t['nbytes']:,}",
                     "yes" if t["contiguous"] else "NO", t["quantization"] or "-"))
    widths = [min(max(len(r[i]) for r in rows), 48) for i in range(len(rows[0]))]
    right = {4, 5}
    return ["  " + "  ".join(c.rjust(w) if i in right else c.ljust(w)
                             for i, (c, w) in enumerate(zip(r, widths, strict=True)))
            for r in rows]


def render_arena(r: dict[str, Any], limit: int) -> list[str]:
    a = r["arena"]
    page, tensors = a["page"], {t["name"]: t for t in r["tensors"]}
    out = [f"one arena of {mb(a['bytes'])} = {a['pages']:,} pages of {page // 1024} KiB, page-aligned; "
           f"tensors packed in file order, each {a['tensor_align']}-byte aligned "
           f"({a['padding']:,} B of padding, {a['shared_pages']} pages shared by two tensors)",
           f"arena start 0x{ARENA_BASE:08X}"]
    placements = a["placements"][:limit] if limit else a["placements"]
    prev_end = 0
    for i, p in enumerate(placements):
        t = tensors[p["name"]]
        last_tensor = i == len(placements) - 1
        branch, stem = ("└──", "    ") if last_tensor else ("├──", "│   ")
        shape = "x".join(map(str, t["shape"])) or "scalar"
        source = f" <- {t['dtype']}" if t["widened"] else ""
        gap = p["offset"] - prev_end
        note = "right after the previous tensor" if gap == 0 else f"{gap} B gap for alignment"
        out.append(f"{branch} {p['name']} ({shape}, {t['out_dtype']}{source}), {p['bytes']:,} B, {note}")
        prev_end = p["offset"] + p["bytes"]
        start = ARENA_BASE + p["offset"]
        shown = range(p["first_page"], p["first_page"] + min(p["pages"], 2))
        for j, pg in enumerate(shown):
            lo = max(ARENA_BASE + p["offset"], ARENA_BASE + pg * page)
            hi = min(ARENA_BASE + p["offset"] + p["bytes"], ARENA_BASE + (pg + 1) * page) - 1
            full = hi - lo + 1 == page
            size = "4KB" if full and page == 4096 else f"{hi - lo + 1} B"
            shared = "; page shared with a neighbour" if not full and p["shares_page"] else ""
            elbow = "└──" if j == len(shown) - 1 and p["pages"] <= 2 else "├──"
            out.append(f"{stem}{elbow} page {pg}: 0x{lo:08X} - 0x{hi:08X} ({size}{shared})")
        if p["pages"] > 2:
            end = ARENA_BASE + p["offset"] + p["bytes"] - 1
            out.append(f"{stem}└── ... {p['pages']:,} pages in all, 0x{start:08X} - 0x{end:08X}")
    if limit and len(a["placements"]) > limit:
        out.append(f"    ({len(a['placements']) - limit} more tensors; --limit 0 shows all)")
    return out


def render(r: dict[str, Any], limit: int = 0) -> str:
    size = r["container"].get("file_size")
    lines = [f"== {r['path']}  ({r['format']}{f', {size:,} bytes' if size else ''})", "",
             f"-- first 64 bytes of {r['file']}"]
    lines += hexdump(bytes.fromhex(r["first_bytes"]))
    lines += ["", "-- container"] + render_container(r)
    lines += ["", "-- tokens that end generation"] + render_end_tokens(r.get("end_tokens"))
    tensors = r["tensors"][:limit] if limit else r["tensors"]
    where = "byte offsets in each tensor's own shard" if "shards" in r["container"] else "absolute file offsets"
    lines += ["", f"-- tensors ({len(r['tensors'])}; offsets are {where}, strides in elements)"]
    lines += render_table(tensors)
    if limit and len(r["tensors"]) > limit:
        lines.append(f"  ... {len(r['tensors']) - limit} more (--limit 0 shows all)")
    t = r["totals"]
    lines += ["", "-- totals",
              f"  {t['tensors']} tensors, {t['elements']:,} elements: {mb(t['stored_bytes'])} in the file"]
    if "model_bytes" in t:
        lines.append(f"  {mb(t['model_bytes'])} once loaded as a model ({t['model_dtype']}; the memory plan's figure)")
    lines.append(f"  {mb(t['loaded_bytes'])} as float32 arrays (the arena below; `loaded` in the table)")
    for dtype, row in t["by_dtype"].items():
        lines.append(f"  {dtype:<10} {row['tensors']:>5} tensors {row['elements']:>14,} elements "
                     f"{mb(row['stored_bytes']):>12} stored {mb(row['loaded_bytes']):>12} loaded")
    lines += ["", "-- planned memory layout"] + render_arena(r, limit)
    return "\n".join(lines)
