"""The sampling a model's file recommends: a GGUF's general.sampling.* keys (written here by the
gguf package, llama.cpp's own writer), a model folder's generation_config.json, nothing for a
file that says nothing."""

import json

import numpy as np
from gguf import GGUFValueType

from scratchllm.formats import load_checkpoint
from scratchllm.formats.sampling_defaults import recommended_sampling


def test_a_gguf_files_sampling_keys(tmp_path, gguf_writer):
    tensors = {"vec": (np.zeros(4, np.float32), "F32")}
    tuned = gguf_writer(tmp_path / "tuned.gguf", tensors, metadata={
        "general.sampling.temp": (0.6, GGUFValueType.FLOAT32, None),
        "general.sampling.top_p": (0.95, GGUFValueType.FLOAT32, None),
        "general.sampling.top_k": (20, GGUFValueType.INT32, None)})
    got = recommended_sampling(load_checkpoint(tuned))
    assert got.keys() == {"temperature", "top_p", "top_k"} and got["top_k"] == 20
    assert abs(got["temperature"] - 0.6) < 1e-6 and abs(got["top_p"] - 0.95) < 1e-6
    plain = gguf_writer(tmp_path / "plain.gguf", tensors)
    assert recommended_sampling(load_checkpoint(plain)) == {}


def test_a_folders_generation_config(tmp_path):
    from safetensors.numpy import save_file

    save_file({"w": np.zeros((2, 2), np.float32)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text("{}")
    ckpt = load_checkpoint(tmp_path)
    assert recommended_sampling(ckpt) == {}
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.7, "top_p": 0.8, "top_k": 20,
                                                                  "do_sample": True, "eos_token_id": 2}))
    assert recommended_sampling(ckpt) == {"temperature": 0.7, "top_p": 0.8, "top_k": 20}
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.7, "do_sample": False}))
    assert recommended_sampling(ckpt) == {"temperature": 0}
    (tmp_path / "generation_config.json").write_text("not json")
    assert recommended_sampling(ckpt) == {}
