"""Inputs the coverage-guided fuzzer (fuzz/) found raising something other than a FormatError, or
exhausting memory, each now a clear FormatError: kept here so they stay fixed."""

import io
import json
import struct
import time
import tracemalloc
import zipfile
from pathlib import Path

import pytest

from scratchllm import FormatError, load_checkpoint
from scratchllm.formats.unpickle import load_state_dict_pickle
from scratchllm.tokenizer import Tokenizer

# PROTO 2, EMPTY_DICT, LONG_BINPUT 2**31 - 1, STOP: a memo index naming a slot 2 billion places on.
HUGE_MEMO = b"\x80\x02}r" + struct.pack("<I", 2**31 - 1) + b"."


def test_a_huge_memo_index_allocates_nothing():
    tracemalloc.start()
    try:
        obj, storages = load_state_dict_pickle(HUGE_MEMO, "data.pkl")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert obj == {} and storages == {}  # a legal pickle: the index is only a name
    assert peak < 1 << 20


def test_a_huge_memo_index_in_a_torch_file(tmp_path):
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("archive/data.pkl", b"\x80\x02}r" + struct.pack("<I", 2**31 - 1) + b"X\x01\x00\x00\x00ah\x00s.")
        z.writestr("archive/version", "3\n")
    path = tmp_path / "m.bin"
    path.write_bytes(buf.getvalue())
    started = time.monotonic()
    with pytest.raises(FormatError, match=r"m\.bin: .*data\.pkl"):
        load_checkpoint(path)  # GET of a memo slot never PUT: malformed, said plainly
    assert time.monotonic() - started < 1


def test_wordpiece_without_its_unknown_token(tmp_path):
    spec = {"model": {"type": "WordPiece", "vocab": {"a": 0}, "unk_token": "[UNK]"}}
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(FormatError, match=r"tokenizer\.json: WordPiece unk_token '\[UNK\]' is not in the vocab"):
        Tokenizer.from_pretrained(tmp_path / "tokenizer.json")


FOUND = Path(__file__).resolve().parents[2] / "fuzz" / "corpus"


def test_found_inputs_are_format_errors(tmp_path):
    """The fuzzer's own finds, kept in its corpus: each a FormatError now."""
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes((FOUND / "gguf" / "found-zero-by-huge.gguf").read_bytes())  # a (0, 2**62) tensor
    with pytest.raises(FormatError, match=r"m\.gguf: tensor 'q' claims .* more than the file can hold"):
        load_checkpoint(gguf)
    tok = tmp_path / "tokenizer.json"
    tok.write_bytes((FOUND / "tokenizer_json" / "found-text-for-an-id.json").read_bytes())  # "sep": [0, "vocab"]
    with pytest.raises(FormatError, match=r"tokenizer\.json: malformed tokenizer\.json \(ValueError"):
        Tokenizer.from_pretrained(tok)
    for found in ("found-no-unk.json", "found-short-post-processor.json", "found-null-prefix.json",
                  "found-huge-id.json", "found-infinite-id.json"):
        tok.write_bytes((FOUND / "tokenizer_json" / found).read_bytes())
        with pytest.raises(FormatError, match="tokenizer.json: "):
            Tokenizer.from_pretrained(tok)
    with pytest.raises(FormatError, match=r"data\.pkl: "):
        load_state_dict_pickle((FOUND / "unpickle" / "found-huge-memo.pkl").read_bytes(), "data.pkl")


@pytest.mark.parametrize(("found", "said"), [
    ("gguf/found-quantized-scalar.gguf", "innermost dimension 1 is not a multiple of the Q4_0 block size 32"),
    ("safetensors/found-list-dtype.safetensors", r"tensor 'empty' has unknown dtype \[0, 2\]"),
])
def test_found_files_are_format_errors(tmp_path, found, said):
    path = tmp_path / ("m." + found.rsplit(".", 1)[1])
    path.write_bytes((FOUND / found).read_bytes())
    with pytest.raises(FormatError, match=said):
        load_checkpoint(path)


def test_a_bytearray8_of_a_terabyte_is_refused_before_allocating():
    """BYTEARRAY8 2**40: the unpickler would allocate the stated length before reading it."""
    pkl = b"\x80\x05\x96" + struct.pack("<Q", 1 << 40) + b"xx."
    tracemalloc.start()
    try:
        for data in (pkl, (FOUND / "unpickle" / "found-bytearray8.pkl").read_bytes()):
            with pytest.raises(FormatError, match="BYTEARRAY8"):
                load_state_dict_pickle(data, "data.pkl")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


@pytest.mark.parametrize("kind", ["WordPiece", "BPE"])
@pytest.mark.parametrize("bad_id", [10**12, 2**63, -1])
def test_a_vocab_id_far_out_is_refused_before_the_id_table(tmp_path, bad_id, kind):
    """The id -> token table is as long as the largest id: 10**12 was 8 TB, 2**63 an OverflowError."""
    spec = {"model": {"type": kind, "vocab": {"[UNK]": 0, "a": bad_id}, "unk_token": "[UNK]", "merges": []},
            "pre_tokenizer": {"type": "ByteLevel"}}
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(FormatError, match=rf"tokenizer\.json: vocab id {bad_id} is outside 0\.\.1031"):
        Tokenizer.from_pretrained(tmp_path / "tokenizer.json")

