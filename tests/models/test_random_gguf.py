"""scripts/make_random_gguf.py writes a Llama GGUF that loads, whose Q4_0 weights are the gguf
package's own dequantization, and whose dtype "quantized" gives float32's logits bit for bit."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from scratchllm.models import ContiguousKVCache, load_model  # noqa: E402

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "make_random_gguf.py"


@pytest.mark.slow  # the gguf package copies the 49152-token vocabulary slowly
def test_tiny_random_llama_loads_quantized_and_matches_float32(tmp_path, default_gguf):
    spec = importlib.util.spec_from_file_location("make_random_gguf", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    path = script.write_random_llama_gguf(tmp_path / "tiny.gguf", **script.SIZES["tiny"], tokenizer_from=default_gguf)
    auto, f32 = load_model(path, dtype="quantized"), load_model(path, dtype="float32")
    assert auto.dtype == "quantized" and auto.config.num_layers == 2 and auto.config.hidden_size == 64
    reader = gguf.GGUFReader(str(path))
    t = next(t for t in reader.tensors if t.name == "blk.1.ffn_down.weight")
    assert t.tensor_type == gguf.GGMLQuantizationType.Q4_0
    want = gguf.quants.dequantize(t.data, t.tensor_type).reshape(64, 128)
    np.testing.assert_array_equal(auto.weights["model.layers.1.mlp.down_proj.weight"], want)
    ids = np.array([1, 500, 9000, 42, 7])
    got = auto.forward(ids, np.arange(5), ContiguousKVCache.for_model(auto.config, 5))
    np.testing.assert_array_equal(got, f32.forward(ids, np.arange(5), ContiguousKVCache.for_model(f32.config, 5)))
