"""Bad files: every one is refused with a FormatError naming the file and the problem; nothing runs."""

import io
import json
import os
import pickle
import struct
import subprocess
import sys
import zipfile

import numpy as np
import pytest

from scratchllm import FormatError, load_checkpoint


def gguf_bytes(tensors=(), kv=(), version=3, magic=b"GGUF", data=b"", data_pad=True):
    """A GGUF file built field by field, so that each field can lie. tensors: (name, ne, type, offset)."""
    def s(text):
        raw = text.encode()
        return struct.pack("<Q", len(raw)) + raw
    out = magic + struct.pack("<IQQ", version, len(tensors), len(kv))
    for key, vtype, payload in kv:
        out += s(key) + struct.pack("<I", vtype) + payload
    for name, ne, ggml_type, offset in tensors:
        out += s(name) + struct.pack("<I", len(ne)) + struct.pack(f"<{len(ne)}Q", *ne)
        out += struct.pack("<IQ", ggml_type, offset)
    if data_pad:
        out += b"\0" * (-len(out) % 32)
    return out + data


def refuses(tmp_path, content: bytes, match: str, name="bad.gguf"):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(FormatError, match=match) as err:
        ckpt = load_checkpoint(path)
        for key in ckpt:  # a lazily found problem counts too
            ckpt[key]
    assert err.value.path == str(path) and str(path) in str(err.value)
    return err.value


# --- GGUF -------------------------------------------------------------------------------------

def test_gguf_good_baseline_loads(tmp_path):
    # The builder itself must make a valid file, or the refusals below prove nothing.
    path = tmp_path / "ok.gguf"
    path.write_bytes(gguf_bytes([("a", [4], 0, 0), ("b", [2], 0, 32)], data=np.arange(16, dtype="<f4").tobytes()))
    ckpt = load_checkpoint(path)
    np.testing.assert_array_equal(ckpt["a"], [0, 1, 2, 3])
    np.testing.assert_array_equal(ckpt["b"], [8, 9])


@pytest.mark.parametrize("content,match", [
    (b"GGML" + b"\0" * 60, "not a GGUF file: magic"),
    (gguf_bytes(version=1), "version 1 is not supported"),
    (gguf_bytes(version=4), "version 4 is not supported"),
    (gguf_bytes(version=3 << 24), "big-endian"),
    (b"GGUF\x03\0\0", "truncated"),
    (gguf_bytes([("a", [64], 0, 0)], data=b"\0" * 100), "ends at byte .* but the file has"),
    (gguf_bytes([("a", [8], 0, 0), ("b", [8], 0, 0)], data=b"\0" * 64), "overlap"),
    (gguf_bytes([("a", [8], 0, 16)], data=b"\0" * 64), "not a multiple of the alignment"),
    (gguf_bytes([("a", [8], 99, 0)], data=b"\0" * 64), "unknown GGML type 99"),
    (gguf_bytes([("a", [8], 0, 0), ("a", [8], 0, 32)], data=b"\0" * 64), "appears twice"),
    (gguf_bytes([("a", [1, 1, 1, 1, 1], 0, 0)], data=b"\0" * 64), "dimensions"),
    (gguf_bytes([("a", [33], 2, 0)], data=b"\0" * 64), "not a multiple of the Q4_0 block size"),
    (gguf_bytes([("a", [2**40, 2**40], 0, 0)], data=b"\0" * 64), "more than the file can hold"),
    (gguf_bytes(kv=[("k", 13, b"\0" * 8)]), "unknown metadata value type 13"),
    (gguf_bytes(kv=[("k", 9, struct.pack("<IQ", 4, 2**50))]), "truncated"),
    (gguf_bytes(kv=[("k", 9, struct.pack("<IQ", 8, 2**40))]), "truncated"),
    (gguf_bytes(kv=[("k", 8, struct.pack("<Q", 2**63))]), "truncated"),
    (gguf_bytes(kv=[("general.alignment", 4, struct.pack("<I", 0))]), "alignment"),
    (b"GGUF" + struct.pack("<IQQ", 3, 2**60, 2**60), "more than the file's .* bytes can hold"),
    (b"", "empty file"),
])
def test_gguf_refusals(tmp_path, content, match):
    refuses(tmp_path, content, match)


def test_truncated_real_gguf(tmp_path, small_gguf):
    data = small_gguf.read_bytes()
    for cut in (3, 10, 100, 600, len(data) - 10):  # the last 4 bytes are padding
        refuses(tmp_path, data[:cut], "truncated|ends at byte")


# --- safetensors ------------------------------------------------------------------------------

def st_bytes(header, data=b"", length=None):
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


F32x2 = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}


@pytest.mark.parametrize("content,match", [
    (b"\x10\0\0", "too short"),
    (st_bytes({"a": F32x2}, b"\0" * 8, length=10**6), "header length 1000000 runs past the end"),
    (st_bytes(b"{not json", b""), "not valid JSON"),
    (st_bytes(b"[1, 2]", b""), "JSON list, expected an object"),
    (st_bytes(b"\xff\xfe", b""), "not valid JSON"),
    (st_bytes({"a": F32x2}, b"\0" * 4), "ends at byte"),
    (st_bytes({"a": F32x2, "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, b"\0" * 12), "overlap"),
    (st_bytes({"a": {"dtype": "F33", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8), "unknown dtype 'F33'"),
    (st_bytes({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8), "needs 12"),
    (st_bytes({"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, b"\0" * 8), "non-negative"),
    (st_bytes({"a": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}}, b"\0" * 8), "begin, end"),
    (st_bytes({"a": [1]}, b""), "not an object"),
    (st_bytes({"__metadata__": [1]}, b""), "__metadata__"),
])
def test_safetensors_refusals(tmp_path, content, match):
    refuses(tmp_path, content, match, name="bad.safetensors")


# --- torch zip and pickles --------------------------------------------------------------------

def torch_zip(path, pickle_bytes: bytes | None, entries: dict | None = None):
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        if pickle_bytes is not None:
            z.writestr("archive/data.pkl", pickle_bytes)
        for name, data in (entries or {}).items():
            z.writestr(f"archive/{name}", data)
    return path


class Planted:
    """Pickles to a call of `func(*args)`: what a malicious checkpoint does."""

    def __init__(self, func, *args):
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


@pytest.mark.parametrize("func,args,name", [
    (os.system, ("touch {marker}",), "posix.system|os.system"),
    (eval, ("open(r'{marker}', 'w')",), "builtins.eval"),
    (exec, ("open(r'{marker}', 'w')",), "builtins.exec"),
    (subprocess.Popen, (["touch", "{marker}"],), "subprocess.Popen"),
    (open, ("{marker}", "w"), "io.open|builtins.open"),
])
def test_planted_pickle_never_runs(tmp_path, func, args, name):
    marker = tmp_path / "pwned"
    args = tuple(a.format(marker=marker) if isinstance(a, str) else [x.format(marker=marker) for x in a]
                 for a in args)
    # The payload sits inside an otherwise normal state dict, as a real attack would.
    payload = pickle.dumps({"ok": 1, "evil": Planted(func, *args)}, protocol=2)
    path = torch_zip(tmp_path / "pytorch_model.bin", payload)
    err = refuses(tmp_path, path.read_bytes(), f"refuses global '({name})'", name="pytorch_model.bin")
    assert "nothing from the file was run" in str(err)
    assert not marker.exists()


def test_planted_pickle_is_live(tmp_path):
    # Proof that the payload above is real: Python's own unpickler does create the file.
    marker = tmp_path / "pwned"
    pickle.loads(pickle.dumps(Planted(eval, f"open(r'{marker}', 'w').close()")))
    assert marker.exists()


def test_reduce_on_an_allowlisted_non_callable_is_refused(tmp_path):
    # GLOBAL torch.FloatStorage is allowed (a storage type) but calling it with REDUCE is not.
    payload = b"\x80\x02ctorch\nFloatStorage\n)R."
    refuses(tmp_path, torch_zip(tmp_path / "x.bin", payload).read_bytes(), "malformed pickle", name="x.bin")


def test_nested_global_names_are_refused(tmp_path):
    payload = b"\x80\x02cbuiltins\ngetattr\n."
    refuses(tmp_path, torch_zip(tmp_path / "x.bin", payload).read_bytes(), "builtins.getattr", name="x.bin")


@pytest.fixture
def torch_file(tmp_path):
    torch = pytest.importorskip("torch")
    path = tmp_path / "good.bin"
    torch.save({"w": torch.arange(12, dtype=torch.float32).reshape(3, 4)}, path)
    return path


def rewrite(src, dst, change):
    """Copy a zip, passing each entry's (name, bytes) through change -> (name, bytes) or None."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            new = change(info.filename, zin.read(info))
            if new is not None:
                zout.writestr(new[0], new[1])
    return dst


def test_torch_zip_refusals(tmp_path, torch_file):
    no_pkl = rewrite(torch_file, tmp_path / "a.bin", lambda n, d: None if n.endswith("data.pkl") else (n, d))
    refuses(tmp_path, no_pkl.read_bytes(), "no <archive>/data.pkl", name="a.bin")
    no_storage = rewrite(torch_file, tmp_path / "b.bin", lambda n, d: None if "/data/" in n else (n, d))
    refuses(tmp_path, no_storage.read_bytes(), "has no zip entry", name="b.bin")
    short = rewrite(torch_file, tmp_path / "c.bin", lambda n, d: (n, d[:-4]) if "/data/" in n else (n, d))
    refuses(tmp_path, short.read_bytes(), "holds 44", name="c.bin")
    # A tensor that reaches past its storage: size (3, 5) over 12 elements.
    def grow_size(n, d):
        return (n, d.replace(b"K\x03K\x04\x86", b"K\x03K\x05\x86")) if n.endswith("data.pkl") else (n, d)

    grow = rewrite(torch_file, tmp_path / "d.bin", grow_size)
    refuses(tmp_path, grow.read_bytes(), "reaches element", name="d.bin")
    data = torch_file.read_bytes()
    refuses(tmp_path, data[: len(data) // 2], "zip", name="e.bin")
    refuses(tmp_path, b"\x80\x02}q\x00.", "legacy", name="f.bin")


def test_cli_prints_one_line_and_exits_2(tmp_path):
    path = tmp_path / "bad.gguf"
    path.write_bytes(b"GGML" + b"\0" * 60)
    out = subprocess.run([sys.executable, "-m", "scratchllm.cli.main", "inspect", str(path)],
                         capture_output=True, text=True)
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and "not a GGUF file" in out.stderr and str(path) in out.stderr
    assert "Traceback" not in out.stderr


def test_unknown_file_kind(tmp_path):
    refuses(tmp_path, b"hello world, not a model", "unknown model file format", name="x.txt")
    with pytest.raises(FormatError, match="no model weights"):
        load_checkpoint(tmp_path)  # a folder with only x.txt in it
    assert io  # (io is used by the helpers of other tests)


# --- sharded checkpoints ----------------------------------------------------------------------

@pytest.mark.parametrize("index,match", [
    ({"metadata": {}}, "no 'weight_map'"),
    ({"weight_map": {"a": "missing.safetensors"}}, "shard 'missing.safetensors' is missing"),
    ({"weight_map": {"a": "../shard.safetensors"}}, "is missing or not a file"),
    ({"weight_map": {"a": "shard.safetensors", "zzz": "shard.safetensors"}}, "does not hold it"),
    ([1, 2], "no 'weight_map'"),
])
def test_index_refusals(tmp_path, index, match):
    pytest.importorskip("safetensors")
    from safetensors.numpy import save_file

    save_file({"a": np.ones(2, np.float32)}, tmp_path / "shard.safetensors")
    path = tmp_path / "model.safetensors.index.json"
    path.write_text(json.dumps(index))
    with pytest.raises(FormatError, match=match):
        load_checkpoint(path)
