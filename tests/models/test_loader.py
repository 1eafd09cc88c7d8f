"""load_model fails loudly on a missing, extra or mis-shaped tensor, and on configs it cannot run."""

import json

import numpy as np
import pytest

from scratchllm.errors import ConfigError, FormatError
from scratchllm.models import load_model
from scratchllm.models.architecture import gguf_to_hf_names
from scratchllm.models.architectures import GEMMA3, LLAMA, PHI3

safetensors_numpy = pytest.importorskip("safetensors.numpy")

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 40, "hidden_size": 16,
          "intermediate_size": 24, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
          "rms_norm_eps": 1e-6, "max_position_embeddings": 32, "tie_word_embeddings": True}


def tiny_llama_tensors():
    rng = np.random.default_rng(0)
    C, I, V, KV = 16, 24, 40, 8
    shapes = {"model.embed_tokens.weight": (V, C), "model.norm.weight": (C,),
              "model.layers.0.input_layernorm.weight": (C,), "model.layers.0.post_attention_layernorm.weight": (C,),
              "model.layers.0.self_attn.q_proj.weight": (C, C), "model.layers.0.self_attn.k_proj.weight": (KV, C),
              "model.layers.0.self_attn.v_proj.weight": (KV, C), "model.layers.0.self_attn.o_proj.weight": (C, C),
              "model.layers.0.mlp.gate_proj.weight": (I, C), "model.layers.0.mlp.up_proj.weight": (I, C),
              "model.layers.0.mlp.down_proj.weight": (C, I)}
    return {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}


def write(folder, tensors, config=CONFIG):
    folder.mkdir(exist_ok=True)
    safetensors_numpy.save_file(tensors, str(folder / "model.safetensors"))
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_loads_and_exposes_checkpoint_names(tmp_path):
    tensors = tiny_llama_tensors()
    model = load_model(write(tmp_path / "ok", tensors))
    assert set(model.weights) == set(tensors)
    for name, value in tensors.items():
        np.testing.assert_array_equal(model.weights[name], value)
    # q|k|v are one fused matrix: k_proj is its columns q_size .. q_size + kv_size
    fused = model.params.layers[0].qkv.numpy()
    q, kv = (tensors[f"model.layers.0.self_attn.{x}_proj.weight"].shape[0] for x in "qk")
    np.testing.assert_array_equal(fused[:, q : q + kv], tensors["model.layers.0.self_attn.k_proj.weight"].T)


def test_bfloat16_weights_are_the_checkpoint_rounded(tmp_path):
    from scratchllm.kernels.packed_gemm import from_bfloat16, to_bfloat16

    tensors = tiny_llama_tensors()
    model = load_model(write(tmp_path / "ok", tensors), dtype="bfloat16")
    for name, value in tensors.items():
        expect = value if value.ndim == 1 else from_bfloat16(to_bfloat16(value))  # norms stay float32
        np.testing.assert_array_equal(model.weights[name], expect)


def test_unknown_dtype_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="dtype"):
        load_model(write(tmp_path / "ok", tiny_llama_tensors()), dtype="float16")


def test_auto_is_float32_for_a_checkpoint_without_quantized_blocks(tmp_path):
    tensors = tiny_llama_tensors()
    model = load_model(write(tmp_path / "ok", tensors), dtype="auto")
    assert model.dtype == "float32" and model.params.layers[0].qkv.dtype == "float32"
    for name, value in tensors.items():
        np.testing.assert_array_equal(model.weights[name], value)


def test_quantized_needs_a_quantized_gguf(tmp_path):
    with pytest.raises(ConfigError, match="quantized keeps a GGUF"):
        load_model(write(tmp_path / "ok", tiny_llama_tensors()), dtype="quantized")


def test_missing_tensor(tmp_path):
    tensors = tiny_llama_tensors()
    del tensors["model.layers.0.mlp.up_proj.weight"]
    with pytest.raises(FormatError, match="lacks tensor 'model.layers.0.mlp.up_proj.weight'"):
        load_model(write(tmp_path / "m", tensors))


def test_misshaped_tensor(tmp_path):
    tensors = tiny_llama_tensors()
    tensors["model.layers.0.self_attn.k_proj.weight"] = np.zeros((16, 16), np.float32)
    with pytest.raises(FormatError, match=r"k_proj.weight' has shape \(16, 16\), expected \(8, 16\)"):
        load_model(write(tmp_path / "m", tensors))


def test_extra_tensor(tmp_path):
    tensors = tiny_llama_tensors()
    tensors["model.layers.1.mlp.up_proj.weight"] = np.zeros((24, 16), np.float32)  # a layer the config lacks
    with pytest.raises(FormatError, match="does not use: model.layers.1.mlp.up_proj.weight"):
        load_model(write(tmp_path / "m", tensors))


def test_missing_config(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        load_model(write(tmp_path / "m", tiny_llama_tensors(), config=None))


@pytest.mark.parametrize("change, message", [
    ({"architectures": ["T5ForConditionalGeneration"], "model_type": "t5"}, "unsupported architecture"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope scaling 'yarn'"),
    ({"num_key_value_heads": 3}, "do not divide"),
])
def test_unsupported_config(tmp_path, change, message):
    with pytest.raises(ConfigError, match=message):
        load_model(write(tmp_path / "m", tiny_llama_tensors(), {**CONFIG, **change}))


def test_gguf_names():
    """GGUF names map to Hugging Face names through the architecture's description."""
    llama = gguf_to_hf_names(LLAMA, 13, qkv_bias=False, o_bias=False)
    assert llama["token_embd.weight"] == "model.embed_tokens.weight"
    assert llama["blk.12.attn_k.weight"] == "model.layers.12.self_attn.k_proj.weight"
    assert llama["blk.3.ffn_gate.weight"] == "model.layers.3.mlp.gate_proj.weight"
    assert llama["blk.3.ffn_norm.weight"] == "model.layers.3.post_attention_layernorm.weight"
    assert llama["output.weight"] == "lm_head.weight"
    assert llama["rope_freqs.weight"] == "rope_freqs.weight"  # Llama 3: kept under its own name
    assert "blk.13.attn_k.weight" not in llama and "blk.1.attn_q.bias" not in llama  # no such layer, no biases
    assert gguf_to_hf_names(LLAMA, 2, True, False)["blk.1.attn_q.bias"] == "model.layers.1.self_attn.q_proj.bias"
    gemma3 = gguf_to_hf_names(GEMMA3, 2, False, False)
    assert gemma3["blk.1.ffn_norm.weight"] == "model.layers.1.pre_feedforward_layernorm.weight"
    assert gemma3["blk.1.post_attention_norm.weight"] == "model.layers.1.post_attention_layernorm.weight"
    assert gemma3["blk.1.attn_q_norm.weight"] == "model.layers.1.self_attn.q_norm.weight"
    phi3 = gguf_to_hf_names(PHI3, 2, False, False)
    assert phi3["blk.1.ffn_up.weight"] == "model.layers.1.mlp.gate_up_proj.weight"
    assert "blk.1.ffn_gate.weight" not in phi3
    assert "blk.1.rope_factors_long.weight" not in phi3


def test_an_accepted_but_unbuilt_field_is_a_format_error_naming_it(tmp_path):
    """mlp_bias: the config reader accepts the key; no forward builds biases on the MLP: refused at
    load, as the file's error, naming the field (not a NotImplementedError from the forward)."""
    with pytest.raises(FormatError, match=r"config.json: mlp_bias: biases on the MLP"):
        load_model(write(tmp_path / "m", tiny_llama_tensors(), {**CONFIG, "mlp_bias": True}))
    load_model(write(tmp_path / "ok", tiny_llama_tensors(), {**CONFIG, "mlp_bias": False}))
