"""`bench accuracy`: the default dtype's logits against the dequantized float32 model's, bounded;
and the figures it prints, checked on made-up logits."""

import argparse

import numpy as np
import pytest

from scratchllm.bench import accuracy
from scratchllm.kernels import packed_gemm


def test_compare_counts_what_it_says():
    ref = [np.array([[0.0, 1.0, 0.5], [2.0, 0.0, 0.0]], dtype=np.float32)]
    rows = [np.array([[0.0, 0.9, 1.0], [2.5, 0.0, 0.0]], dtype=np.float32)]  # the first argmax moves
    f = accuracy.compare(rows, ref, [[4, 5, 6]], [[4, 5, 7]])
    assert f["max_abs_diff"] == pytest.approx(0.5) and f["max_abs_diff_over_max_logit"] == pytest.approx(0.25)
    assert f["argmax_agree"] == 0.5 and f["greedy_agree_steps"] == [2] and f["greedy_agree_min"] == 2
    assert accuracy.agreement([1, 2], [1, 2]) == 2 and accuracy.agreement([], [1]) == 0


@pytest.mark.slow
def test_the_default_dtype_stays_within_a_thousandth_of_float32(default_gguf):
    parser = argparse.ArgumentParser()
    accuracy.add_arguments(parser)
    r = accuracy.run(parser.parse_args(["--dtypes", "auto,int16,quantized", "--steps", "16", "--no-peer"]))
    auto, int16, exact = r["figures"]["auto"], r["figures"]["int16"], r["figures"]["quantized"]
    # the default: int16 where the build has VNNI dot products, the exact path elsewhere
    assert auto["dtype"] == ("int16" if packed_gemm.INT_DOT_INSTRUCTION else "quantized")
    assert len(r["inputs"]["prompt_tokens"]) == 3
    assert int16["max_abs_diff_over_max_logit"] < 1e-3 and int16["argmax_agree"] == 1.0
    assert int16["greedy_agree_steps"] == [16, 16, 16]
    assert exact["max_abs_diff"] == 0 and exact["greedy_agree_min"] == 16  # the exact path: float32's bits
    assert f"auto ({auto['dtype']})" in accuracy.render(r)


# llama.cpp's closeness to the float32 model on qwen2.5-coder-0.5b, measured here with `scratchllm
# bench accuracy --model qwen2.5-coder-0.5b --steps 64` (llama-cpp-python 0.3.36 built by `make
# peers`, 2026-12-06): largest |difference| 0.654 (0.0207 of the largest logit), argmax 99.5%,
# greedy agreement 64 / 7 / 64 steps. "auto" is int8 there; it must stay at least as close.
LLAMA_CPP_05B = {"max_abs_diff_over_max_logit": 0.0207, "argmax_agree": 0.995}


@pytest.mark.slow
def test_auto_on_a_half_billion_model_is_int8_and_no_further_than_llama_cpp():
    if not packed_gemm.INT_DOT_INSTRUCTION:
        pytest.skip("without VNNI dot products auto is the exact path")
    parser = argparse.ArgumentParser()
    accuracy.add_arguments(parser)
    r = accuracy.run(parser.parse_args(["--model", "qwen2.5-coder-0.5b", "--dtypes", "auto", "--steps", "16",
                                        "--no-peer"]))
    auto = r["figures"]["auto"]
    assert auto["dtype"] == "int8"
    assert auto["max_abs_diff_over_max_logit"] <= LLAMA_CPP_05B["max_abs_diff_over_max_logit"]
    assert auto["argmax_agree"] >= LLAMA_CPP_05B["argmax_agree"]
    assert auto["greedy_agree_steps"] == [16, 16, 16]  # llama.cpp's second prompt parts at step 7
