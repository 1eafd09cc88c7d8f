"""`bench peers`: both sides measured in their own child process on the same file; without the
peer installed it says so and reports ours alone."""

import argparse

import pytest

from scratchllm.bench import peers
from scratchllm.kernels import packed_gemm


@pytest.mark.slow
def test_a_short_round_measures_every_row(monkeypatch):
    monkeypatch.setattr(peers, "peer_installed", lambda: False)  # the peer's side is its own test below
    monkeypatch.setattr(peers.peers_llama_cpp, "available", lambda: False)  # and llama.cpp's programs theirs
    parser = argparse.ArgumentParser()
    peers.add_arguments(parser)
    args = parser.parse_args(["--rounds", "1", "--prompt-tokens", "24", "--new-tokens", "3", "--batch", "2",
                              "--bandwidth-mb", "64", "--decode-context", "40", "--spec-cases", "0"])
    r = peers.run(args)
    assert r["inputs"]["decode_context"] == 40
    ours = r["figures"]["ours"]
    for key, _, _ in peers.ROWS:
        assert ours[key] > 0, key
    # the default dtype on a quantized GGUF file: int16 where the build has VNNI dot products
    assert r["inputs"]["ours_dtype"] == ("int16" if packed_gemm.INT_DOT_INSTRUCTION else "quantized")
    assert ours["peak_rss_mb"] >= ours["rss_after_load_mb"]
    assert len(r["rounds"]["ours"][0]["greedy"]) == 3
    text = peers.render(r)
    assert "not installed" in text and "make peers" in text and "llama-bench" in text
    assert "against llama.cpp's own programs" not in text and r["inputs"]["ours_kv_cache_dtype"] == "float16"
    assert "3 steps after a 40-token prompt" in text


@pytest.mark.slow
@pytest.mark.skipif(not peers.peer_installed(), reason="llama-cpp-python not installed (make peers)")
def test_the_peer_runs_the_same_file():
    parser = argparse.ArgumentParser()
    peers.add_arguments(parser)
    r = peers.run(parser.parse_args(["--rounds", "1", "--prompt-tokens", "24", "--new-tokens", "3", "--batch", "2",
                                     "--bandwidth-mb", "64", "--spec-cases", "0"]))
    for key, _, _ in peers.ROWS:
        assert r["figures"][peers.PEER][key] > 0 and r["advantage"][key] > 0, key
    # the same file and ids on both sides: their greedy tokens agree at every step, or part only at
    # a near-tie, where both sides' two best logits were within 0.5 of each other (rounding decides)
    assert [len(r["rounds"][side][0]["greedy"]) for side in ("ours", peers.PEER)] == [3, 3]
    parting = r.get("greedy_parting")
    assert r["greedy_ids_agree_for"] == 3 or max(parting["top2_gap"].values()) < 0.5, parting


@pytest.mark.slow
@pytest.mark.skipif(not peers.peers_llama_cpp.available(), reason="llama.cpp's programs not built (make peers)")
def test_llama_cpp_programs_are_measured_at_each_concurrency(monkeypatch):
    monkeypatch.setattr(peers, "peer_installed", lambda: False)
    parser = argparse.ArgumentParser()
    peers.add_arguments(parser)
    r = peers.run(parser.parse_args(["--rounds", "1", "--prompt-tokens", "24", "--new-tokens", "3", "--batch", "2",
                                     "--bandwidth-mb", "64", "--sequences", "1,2", "--spec-cases", "1"]))
    rows = r["llama_cpp_tools"]["rows"]
    for key in ("prefill", "decode"):
        assert rows[key]["ours"] > 0 and rows[key]["llama.cpp"] > 0 and rows[key]["advantage"] > 0
    for n in (1, 2):
        cell = rows[f"seq{n}"]
        assert cell["ours"]["tok_s"] > 0 and cell["llama.cpp"]["tok_s"] > 0
        assert cell["ours"]["peak_rss_mb"] > 50 and cell["llama.cpp"]["peak_rss_mb"] > 50  # each its own process
        assert cell["kv_dtype"] == "float16"
    text = peers.render(r)
    assert "llama-bench pp24" in text and "2 at once, 32 + 3 each" in text
    # the speculative-decoding rows (bench spec's, one code edit here): ours beside llama.cpp's n-gram modes
    spec = r["sections"]["spec"]["rows"]["code-edits"]
    assert all(spec[side]["decode_tok_s"] > 0 for side in ("off", "ngram", "ngram-simple", "ngram-mod", "lookup"))
    assert "speculative decoding, code edits" in text


def test_step_breakdown_splits_a_decode_step(tmp_path):
    from scratchllm.bench.step_profile import render_breakdown, step_breakdown
    from scratchllm.kernels import pointwise
    from scratchllm.models import llama, load_model
    from scratchllm.models.packed import PackedWeight
    from tests.models.test_loader import tiny_llama_tensors, write

    model = load_model(write(tmp_path / "tiny", tiny_llama_tensors()))
    original = llama.linear_into, PackedWeight.__rmatmul__, pointwise.add_rms_norm
    ms = step_breakdown(model, steps=4, prompt_len=3)
    # the timers are gone afterwards
    assert (llama.linear_into, PackedWeight.__rmatmul__, pointwise.add_rms_norm) == original
    assert ms["layer_matmuls"] > 0 and ms["lm_head"] > 0 and ms["attention"] > 0 and ms["rest"] > 0
    assert ms["matmuls"] == ms["layer_matmuls"] + ms["lm_head"]
    assert abs(ms["matmuls"] + ms["attention"] + ms["rest"] + ms["python"] - ms["total"]) < 1e-9
    assert ms["python"] >= 0  # the timed parts happen inside the step's wall time
    assert "matmuls" in render_breakdown(ms)


def test_step_breakdown_times_the_matmuls_the_model_calls(default_gguf):
    """A decode step of the default model reads ~80 MB of weights in its matmuls: they are most of
    the step. (Timing only packed_gemm.matmul, which the layers no longer call, put them at a sixth.)"""
    from scratchllm.bench.step_profile import step_breakdown
    from scratchllm.models import load_model

    ms = step_breakdown(load_model(default_gguf), steps=8)
    assert ms["matmuls"] > 0.4 * ms["total"], ms
    assert ms["layer_matmuls"] > ms["lm_head"] > 0  # 30 layers of 7 matrices against one [576, 49152] head


def test_greedy_and_gap_equals_a_sort():
    import numpy as np

    rng = np.random.default_rng(0)
    rows = rng.standard_normal((50, 300)).astype(np.float32)
    rows[1, 0] = rows[2, -1] = 10.0  # the best at either end
    rows[3, [7, 8]] = 10.0  # a tie: a gap of 0
    for row in rows:
        top = np.sort(row)[-2:]
        assert peers.greedy_and_gap(row) == (int(np.argmax(row)), float(top[1] - top[0]))


def test_step_breakdown_takes_a_fused_kernels_own_split():
    """A model whose blocks run in one C call reports the kernel's counters of each forward."""
    import time
    from types import SimpleNamespace

    import numpy as np
    import pytest

    from scratchllm.bench.step_profile import step_breakdown
    from tests.engine.tiny import tiny_llama

    config = tiny_llama().config
    kernel = SimpleNamespace(matmul_ns=0, attention_ns=0, other_ns=0)

    class Fused:  # the shape of a model with params.blocks: no layer leaf is called
        params = SimpleNamespace(blocks=kernel)

        def __init__(self):
            self.config = config

        def forward(self, ids, positions, attention, logits_rows=None):
            time.sleep(0.002)
            kernel.matmul_ns, kernel.attention_ns, kernel.other_ns = 1_200_000, 300_000, 100_000
            return np.zeros((1, config.vocab_size), np.float32)

    ms = step_breakdown(Fused(), steps=5, prompt_len=2)
    assert ms["layer_matmuls"] == pytest.approx(1.2) and ms["attention"] == pytest.approx(0.3)
    assert ms["rest"] == pytest.approx(0.1) and ms["lm_head"] == 0
    assert ms["total"] >= 2.0 and ms["python"] == pytest.approx(ms["total"] - 1.6)


def test_decode_context_lengthens_the_decode_prompt_only():
    base = peers.workload(5000, {"prompt_tokens": 7, "batch": 3})
    deep = peers.workload(5000, {"prompt_tokens": 7, "batch": 3, "decode_context": 40})
    short = peers.workload(5000, {"prompt_tokens": 7, "batch": 3, "decode_context": 5})
    assert len(base["decode"]) == 16 and len(deep["decode"]) == 40 and short["decode"] == base["decode"][:5]
    assert deep["decode"][:16] == base["decode"] and len(set(deep["decode"][16:])) > 1
    for other in ("prefill", "batch"):  # the other rows measure what they always did
        assert deep[other] == base[other] == short[other]


@pytest.mark.parametrize("flag", ["--rounds", "--new-tokens", "--decode-context", "--batch"])
def test_a_count_below_one_is_refused_before_anything_runs(flag):
    from scratchllm.errors import ConfigError

    parser = argparse.ArgumentParser()
    peers.add_arguments(parser)
    with pytest.raises(ConfigError, match=f"{flag} must be >= 1"):
        peers.run(parser.parse_args([flag, "0"]))


def test_rows_longer_than_the_models_context_are_refused_before_anything_runs():
    from scratchllm.errors import ConfigError

    parser = argparse.ArgumentParser()
    peers.add_arguments(parser)
    with pytest.raises(ConfigError, match="9010 positions .* model's context of 8192"):
        peers.run(parser.parse_args(["--decode-context", "9000", "--new-tokens", "10"]))
