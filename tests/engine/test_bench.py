"""`scratchllm bench engine` and `bench masks` end to end on small inputs: the tables render, the
ratios are computed, and continuous and static batching make identical greedy outputs."""

import argparse
import json

import numpy as np
import pytest
from safetensors.numpy import save_file

from scratchllm.bench import engine as bench_engine
from scratchllm.bench import masks as bench_masks
from scratchllm.errors import ConfigError

from .tiny import tiny_llama


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    """The tiny random Llama written as a Hugging Face folder, so the bench loads it like any model."""
    model = tiny_llama(seed=2, ctx=256)
    c = model.config
    folder = tmp_path_factory.mktemp("tiny-llama")
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": c.vocab_size,
              "hidden_size": c.hidden_size, "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_heads,
              "num_key_value_heads": c.num_kv_heads, "intermediate_size": c.intermediate_size,
              "rms_norm_eps": c.norm_eps, "max_position_embeddings": c.max_position_embeddings,
              "tie_word_embeddings": False}
    (folder / "config.json").write_text(json.dumps(config))
    save_file({k: np.ascontiguousarray(v) for k, v in model.weights.items()}, str(folder / "model.safetensors"))
    return folder


def parse(module, argv):
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", action="store_true")
    module.add_arguments(parser)
    return parser.parse_args(argv)


@pytest.mark.parametrize("rate", ["0", "200"])
def test_bench_engine_on_a_tiny_model(tiny_folder, rate):
    args = parse(bench_engine, ["--model", str(tiny_folder), "--requests", "6", "--prompt-len", "4,40",
                                "--output-len", "2,12", "--batch-size", "3", "--max-seqs", "8", "--decode-seqs", "4",
                                "--skip", "chat", "--rate", rate])
    result = bench_engine.run(args)
    figs, ratios = result["figures"], result["ratios"]
    assert figs["identical_outputs"] == "6/6"  # the baseline and the engine agree token for token
    assert figs["continuous"]["output_tokens"] == figs["static"]["output_tokens"]
    # the same-memory run gets a pool of the bytes static reserved (whole blocks), and more sequences
    from scratchllm.engine.kv_sizing import block_bytes
    from scratchllm.models import load_model

    block = block_bytes(load_model(tiny_folder).config, 16)
    assert 0 <= figs["static"]["peak_kv_bytes"] - figs["continuous"]["kv_pool_bytes"] < block
    assert figs["continuous"]["max_num_seqs"] == 8 and figs["continuous_same_seqs"]["max_num_seqs"] == 3
    # the small-KV run: half of static's bytes (whole blocks), the same outputs (counted above)
    small = figs["continuous_small_kv"]
    assert small["peak_kv_bytes"] <= small["kv_pool_bytes"] and small["max_num_seqs"] == 8
    # half of static's reservation, or what the longest request needs if that is more (with
    # arrivals, static's batches may hold one request: half of it would not fit that request)
    assert small["kv_pool_bytes"] > figs["static"]["peak_kv_bytes"] // 2 - block
    if rate == "0":  # batches of 3 at once: half holds the longest request
        assert ratios["kv_pool_small_over_static"] <= 0.5
    if rate == "0":  # all at once: batches of 3 mixed lengths pad; with arrivals a batch may be 1
        assert figs["static"]["padded_tokens"] > 0
    assert figs["static"]["peak_kv_bytes"] > 0 and figs["continuous"]["peak_kv_bytes"] > 0
    assert {"throughput_continuous_over_static", "p99_static_over_continuous", "kv_saving",
            "decode_batched_over_single"} <= set(ratios)
    if rate == "0":  # offline: latency is measured again under load, at 0.8 x static's requests/s
        lat = figs["latency"]
        assert lat["requests"] == 6 and lat["identical_outputs"] == "6/6"
        assert lat["rate"] == pytest.approx(0.8 * figs["static"]["requests_per_s"])
        assert {"p99_under_load_static_over_continuous", "kv_saving_under_load"} <= set(ratios)
    else:
        assert "latency" not in figs
    text = bench_engine.render(result)
    assert "continuous" in text and "127 vs 89 QPS" in text and "batched decode" in text
    assert "of static's KV memory" in text and "0.5 x KV" in text
    json.dumps(result, default=str)


def test_bench_masks_small():
    args = parse(bench_masks, ["--batch", "2,4", "--max-len", "32", "--repeat", "1"])
    result = bench_masks.run(args)
    assert len(result["figures"]) == 6 and all(r["ms"]["vectorized"] > 0 for r in result["figures"])
    assert "python/vec" in bench_masks.render(result)


@pytest.mark.parametrize("value", ["-0.1", "1.5"])
def test_bench_engine_refuses_a_kv_fraction_outside_0_1(tiny_folder, value):
    from scratchllm.errors import ConfigError

    with pytest.raises(ConfigError, match="--kv-fraction"):
        bench_engine.run(parse(bench_engine, ["--model", str(tiny_folder), "--kv-fraction", value]))


@pytest.mark.parametrize("flag", ["--latency-requests", "--max-seqs", "--requests"])
def test_bench_engine_refuses_counts_below_one(tiny_folder, flag):
    from scratchllm.errors import ConfigError

    with pytest.raises(ConfigError, match=flag):
        bench_engine.run(parse(bench_engine, ["--model", str(tiny_folder), flag, "0"]))


def test_bench_engine_prints_the_policies_side_by_side(tiny_folder, tmp_path):
    plot = tmp_path / "engine.png"
    args = parse(bench_engine, ["--model", str(tiny_folder), "--requests", "6", "--prompt-len", "4,40",
                                "--output-len", "2,12", "--batch-size", "3", "--max-seqs", "8", "--skip",
                                "chat,decode", "--policies", "priority,fcfs", "--latency-requests", "4",
                                "--plot", str(plot)])
    result = bench_engine.run(args)
    import matplotlib.image

    assert matplotlib.image.imread(plot).shape[:2] == (450, 1500)
    json.dumps(result)  # what --json prints: the plotted series are not in it
    figs = result["figures"]
    assert set(figs["policies"]) == {"priority", "fcfs"}
    assert figs["identical_outputs"] == "6/6"  # the policy changes the order, never the tokens
    assert figs["latency"]["continuous_fcfs"]["p99_ms"] > 0
    assert "admission policies" in bench_engine.render(result)
    with pytest.raises(ConfigError):
        bench_engine.run(parse(bench_engine, ["--model", str(tiny_folder), "--policies", "lottery"]))


def test_bench_engine_chat_prints_no_peer_figure_it_did_not_measure():
    result = bench_engine.run(parse(bench_engine, ["--skip", "mixed,decode", "--chat-new-tokens", "2"]))
    chat = result["figures"]["chat"]
    assert chat["sequences"] == 16 and chat["aggregate_tok_s"] > 0
    assert result["peer"] is None and not any("llama" in key for key in result["ratios"])
    assert "llama.cpp not measured" in bench_engine.render(result)


def test_bench_engine_peer_refuses_what_it_cannot_compare(tiny_folder):
    from scratchllm.bench import peers

    with pytest.raises(ConfigError, match="drop chat from --skip"):
        bench_engine.run(parse(bench_engine, ["--model", str(tiny_folder), "--skip", "chat", "--peer", "llama.cpp"]))
    with pytest.raises(ConfigError, match="GGUF file" if peers.peer_installed() else "make peers"):
        bench_engine.run(parse(bench_engine, ["--model", str(tiny_folder), "--peer", "llama.cpp"]))


@pytest.mark.slow
def test_bench_engine_measures_the_peer_on_the_same_chat_ids():
    from scratchllm.bench import peers

    if not peers.peer_installed():
        pytest.skip("llama-cpp-python not installed (make peers)")
    result = bench_engine.run(parse(bench_engine, ["--skip", "mixed,decode", "--chat-new-tokens", "2", "--threads",
                                                   "2", "--peer", "llama.cpp"]))
    peer = result["peer"]
    assert peer["child_runs"] == 2 and peer["threads"] == 2 and peer["chat_aggregate_tok_s"] > 0
    assert result["ratios"]["chat_over_llama_cpp"] == pytest.approx(
        result["figures"]["chat"]["aggregate_tok_s"] / peer["chat_aggregate_tok_s"])
    assert "measured here, now" in bench_engine.render(result)
