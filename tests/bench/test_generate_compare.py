"""`bench generate` measures the exact path beside the default integer products, in turns."""

import argparse
import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("gguf")

from scratchllm.bench import generate

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "make_random_gguf.py"


def test_the_exact_path_is_timed_beside_the_default(tmp_path):
    spec = importlib.util.spec_from_file_location("make_random_gguf", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    path = script.write_random_llama_gguf(tmp_path / "tiny.gguf", **script.SIZES["tiny"], vocab=256)
    parser = argparse.ArgumentParser()
    generate.add_arguments(parser)
    args = parser.parse_args(["--model", str(path), "--dtype", "int16", "--prompt-tokens", "8", "--new-tokens", "4",
                              "--repeat", "2", "--bandwidth-mb", "8", "--threads", "1"])
    r = generate.run(args)
    c = r["figures"]["compare"]
    assert r["inputs"]["weights_dtype"] == "int16" and c["dtype"] == "quantized" and c["rounds"] == 2
    for key in ("model_decode_tok_s", "other_decode_tok_s", "model_prefill_tok_s", "decode_ratio", "prefill_ratio"):
        assert c[key] > 0, key
    assert c["other_decode_vs_bound"] == pytest.approx(c["other_decode_tok_s"] / r["figures"]["bound_tok_s"])
    assert "int16 beside quantized" in generate.render(r)
    off = generate.run(parser.parse_args(["--model", str(path), "--dtype", "int16", "--prompt-tokens", "8",
                                          "--new-tokens", "4",
                                          "--repeat", "1", "--bandwidth-mb", "8", "--threads", "1",
                                          "--compare", "none"]))
    assert off["figures"]["compare"] is None


def test_an_engine_step_of_many_sequences_is_split_into_its_parts(tmp_path):
    from scratchllm.bench.step_profile import batched_breakdown, render_batched
    from scratchllm.engine import engine as engine_module
    from scratchllm.engine import sampler
    from scratchllm.models import load_model

    spec = importlib.util.spec_from_file_location("make_random_gguf", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    model = load_model(script.write_random_llama_gguf(tmp_path / "tiny.gguf", **script.SIZES["tiny"], vocab=256))
    ms = batched_breakdown(model, sequences=4, steps=3, prompt_len=8)
    assert ms["sequences"] == 4 and ms["total"] > 0
    for part in ("layer_matmuls", "lm_head", "attention", "rest", "sampling"):
        assert 0 < ms[part] < ms["total"], part
    assert ms["python"] == pytest.approx(ms["total"] - ms["matmuls"] - ms["attention"] - ms["rest"] - ms["sampling"])
    assert engine_module.sample is sampler.sample  # the timed sampling path put back as it was
    assert "an engine step of 4 sequences" in render_batched(ms)
