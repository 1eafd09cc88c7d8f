"""A split GGUF model (formats/gguf_split.py) runs as the file it was split from: the same logits
bit for bit, quantized and float32; its panel cache is keyed on every shard; LLM generates the same
tokens from any shard's path.

The shards are written by scripts/make_random_gguf.py through the gguf package's split writer
(metadata in the first shard, split.no / split.count / split.tensors.count in each, as llama.cpp's
gguf-split lays them out; gguf-split itself is not built here, so it is not the oracle)."""

import importlib.util
import os
from pathlib import Path

import numpy as np
import pytest

from scratchllm.models import ContiguousKVCache, load_model, panel_cache_files
from scratchllm.models import panel_cache as pc

pytest.importorskip("gguf")

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "make_random_gguf.py"
IDS = np.array([1, 200, 90, 42, 7])


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("make_random_gguf", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def single_and_split(script, folder: Path, **options) -> tuple[Path, Path]:
    """The tiny random Llama as one file and as 3 shards (20 tensors: 7 + 7 + 6)."""
    single = script.write_random_llama_gguf(folder / "one" / "tiny.gguf", **script.SIZES["tiny"], **options)
    first = script.write_random_llama_gguf(folder / "split" / "tiny.gguf", **script.SIZES["tiny"], **options,
                                           split_max_tensors=7)
    assert sorted(p.name for p in first.parent.iterdir()) == [f"tiny-0000{k}-of-00003.gguf" for k in (1, 2, 3)]
    return single, first


def logits(model):
    return model.forward(IDS, np.arange(len(IDS)), ContiguousKVCache.for_model(model.config, len(IDS)))


@pytest.fixture
def folders(tmp_path):
    for name in ("one", "split"):
        (tmp_path / name).mkdir()
    return tmp_path


def test_split_logits_equal_the_single_files_bit_for_bit(script, folders, monkeypatch):
    monkeypatch.setenv("SCRATCHLLM_PANEL_CACHE", "0")
    single, first = single_and_split(script, folders, vocab=256)
    for dtype in ("quantized", "float32"):
        split_model, single_model = load_model(first, dtype=dtype), load_model(single, dtype=dtype)
        assert split_model.dtype == dtype
        np.testing.assert_array_equal(logits(split_model), logits(single_model))


def test_the_panel_cache_of_a_split_model_is_keyed_on_every_shard(script, folders, monkeypatch):
    monkeypatch.setenv("SCRATCHLLM_CACHE_DIR", str(folders / "cache"))
    monkeypatch.delenv("SCRATCHLLM_PANEL_CACHE", raising=False)
    _, first = single_and_split(script, folders, vocab=256)
    shards = [first.with_name(f"tiny-0000{k}-of-00003.gguf") for k in (1, 2, 3)]
    packed = load_model(first, dtype="quantized")
    (cache,) = pc.cache_dir().glob("*.panels")
    assert pc.read_source(cache) == ([str(s.resolve()) for s in shards], pc.source_stat(*shards))
    mapped = load_model(first, dtype="quantized")
    assert not packed.panels_from_cache and mapped.panels_from_cache
    np.testing.assert_array_equal(logits(mapped), logits(packed))
    st = shards[2].stat()
    os.utime(shards[2], ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # the last shard touched
    assert [f.stale for f in panel_cache_files.cache_files()] == [True]  # not as it was packed from
    again = load_model(first, dtype="quantized")  # the same bytes: the key is the content's
    assert again.panels_from_cache and [f.stale for f in panel_cache_files.cache_files()] == [False]
    changed = bytearray(shards[2].read_bytes())
    changed[-1] ^= 1  # a bit of the last shard's last tensor
    shards[2].write_bytes(bytes(changed))
    assert [f.stale for f in panel_cache_files.cache_files()] == [True]
    repacked = load_model(first, dtype="quantized")
    assert not repacked.panels_from_cache  # a new key: the old panels are never read
    (fresh,) = pc.cache_dir().glob("*.panels")  # the stale cache pruned as the new one was written
    assert fresh != cache and pc.read_source(fresh)[1] == pc.source_stat(*shards)


@pytest.mark.slow  # the gguf package copies the 49152-token vocabulary slowly (twice)
def test_llm_generates_the_same_tokens_from_any_shard(script, folders, default_gguf, monkeypatch):
    from scratchllm import LLM, SamplingParams
    from scratchllm.tokenizer import Tokenizer

    monkeypatch.setenv("SCRATCHLLM_PANEL_CACHE", "0")
    single, first = single_and_split(script, folders, tokenizer_from=default_gguf)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = LLM(str(single)).generate("The three primary colors are", params)[0].token_ids
    last = first.with_name("tiny-00003-of-00003.gguf")
    for ref in (first, last):
        assert LLM(str(ref)).generate("The three primary colors are", params)[0].token_ids == want
    # the tokenizer alone, from a later shard, is the first shard's
    assert Tokenizer.from_pretrained(str(last)).encode("Hi") == Tokenizer.from_pretrained(str(single)).encode("Hi")
