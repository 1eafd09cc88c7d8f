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
    args = parser.parse_args(["--model", str(path), "--prompt-tokens", "8", "--new-tokens", "4", "--repeat", "2",
                              "--bandwidth-mb", "8", "--threads", "1"])
    r = generate.run(args)
    c = r["figures"]["compare"]
    assert r["inputs"]["weights_dtype"] == "int16" and c["dtype"] == "quantized" and c["rounds"] == 2
    for key in ("model_decode_tok_s", "other_decode_tok_s", "model_prefill_tok_s", "decode_ratio", "prefill_ratio"):
        assert c[key] > 0, key
    assert c["other_decode_vs_bound"] == pytest.approx(c["other_decode_tok_s"] / r["figures"]["bound_tok_s"])
    assert "int16 beside quantized" in generate.render(r)
    off = generate.run(parser.parse_args(["--model", str(path), "--prompt-tokens", "8", "--new-tokens", "4",
                                          "--repeat", "1", "--bandwidth-mb", "8", "--threads", "1",
                                          "--compare", "none"]))
    assert off["figures"]["compare"] is None
