"""Sampling, `LLM.generate`, `scratchllm generate` and `scratchllm bench generate`."""

import argparse
import json

import numpy as np
import pytest

from scratchllm import LLM, SamplingParams
from scratchllm.errors import ConfigError
from scratchllm.sampling import filtered_probs, make_rng, sample_token, top_logprobs

# ---- sampling --------------------------------------------------------------------------------

LOGITS = np.log(np.array([0.5, 0.3, 0.15, 0.05]))


def draws(logits, params, n):
    rng = make_rng(params)
    return np.array([sample_token(logits, params, rng) for _ in range(n)])


def test_greedy_is_argmax():
    logits = np.random.default_rng(0).standard_normal(1000)
    assert sample_token(logits, SamplingParams(temperature=0), make_rng(SamplingParams())) == logits.argmax()


def test_frequencies_follow_the_distribution():
    counts = np.bincount(draws(LOGITS, SamplingParams(temperature=1.0, seed=0), 20000), minlength=4)
    np.testing.assert_allclose(counts / 20000, np.exp(LOGITS), atol=0.015)


def test_temperature_reshapes():
    p = filtered_probs(LOGITS, SamplingParams(temperature=0.5))
    want = np.exp(LOGITS / 0.5) / np.exp(LOGITS / 0.5).sum()
    np.testing.assert_allclose(p, want, rtol=1e-12)


@pytest.mark.parametrize("top_k, support", [(1, {0}), (2, {0, 1}), (3, {0, 1, 2})])
def test_top_k_support(top_k, support):
    assert set(draws(LOGITS, SamplingParams(top_k=top_k, seed=1), 2000)) == support


@pytest.mark.parametrize("top_p, support", [(0.5, {0}), (0.79, {0, 1}), (0.81, {0, 1, 2}), (1.0, {0, 1, 2, 3})])
def test_top_p_keeps_the_smallest_nucleus(top_p, support):
    p = filtered_probs(LOGITS, SamplingParams(top_p=top_p))
    assert set(np.flatnonzero(p)) == support
    assert p.sum() == pytest.approx(1.0)


def test_seed_reproducible_and_distinct():
    logits = np.random.default_rng(0).standard_normal(500)
    a = draws(logits, SamplingParams(seed=7), 50)
    assert np.array_equal(a, draws(logits, SamplingParams(seed=7), 50))
    assert not np.array_equal(a, draws(logits, SamplingParams(seed=8), 50))


def test_top_logprobs():
    torch = pytest.importorskip("torch")
    logits = np.random.default_rng(3).standard_normal(50).astype(np.float32)
    lp, top = top_logprobs(logits, 7, 3)
    want = torch.log_softmax(torch.tensor(logits, dtype=torch.float64), -1).numpy()
    assert lp == pytest.approx(want[7], abs=1e-9)
    assert [t for t, _ in top] == list(np.argsort(-want)[:3])


@pytest.mark.parametrize("bad", [dict(max_tokens=0), dict(temperature=-1), dict(top_k=-1), dict(top_p=0.0),
                                 dict(top_p=1.5), dict(stop=("",)), dict(logprobs=-1)])
def test_bad_params(bad):
    with pytest.raises(ConfigError):
        SamplingParams(**bad)


# ---- LLM on the real default model -------------------------------------------------------------

CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def llm():
    return LLM("default")


@pytest.mark.slow
def test_chat_answers_paris_and_stops_at_eos(llm):
    out = llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=24))
    assert "Paris" in out.text
    assert out.finish_reason == "stop" and out.token_ids[-1] == llm.eos_token_id
    assert out.text == llm.tokenizer.decode(out.token_ids[:-1])  # the end token is not text
    assert out.metrics.prompt_tokens == len(out.prompt_token_ids)


@pytest.mark.slow
def test_length_stop_strings_stop_ids_and_streaming(llm):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    full = llm.generate("The three primary colors are", params)[0]
    assert full.finish_reason == "length" and len(full.token_ids) == 12
    # token ids are accepted as the prompt and give the same continuation
    assert llm.generate([full.prompt_token_ids], params)[0].token_ids == full.token_ids

    # a stop string taken from the middle of the greedy text: the text ends right before it
    stop = full.text[len(full.text) // 2 : len(full.text) // 2 + 3]
    pieces = []
    out = llm.run(full.prompt_token_ids, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop]),
                  on_token=lambda _id, text: pieces.append(text))
    assert out.finish_reason == "stop" and out.text == full.text[: full.text.index(stop)]
    assert "".join(pieces) == out.text  # streamed deltas add up, never showing the stop string

    stop_id = full.token_ids[4]
    out = llm.generate("The three primary colors are", SamplingParams(temperature=0, max_tokens=12,
                                                                      stop_token_ids=[stop_id], ignore_eos=True))[0]
    assert out.token_ids == full.token_ids[: full.token_ids.index(stop_id) + 1] and out.finish_reason == "stop"


@pytest.mark.slow
def test_seeded_sampling_is_reproducible(llm):
    p = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=8, seed=42, ignore_eos=True, logprobs=2)
    a, b = llm.generate(["Once upon a time", "Once upon a time"], p)
    assert a.token_ids == b.token_ids and a.text == b.text
    assert len(a.logprobs) == 8 and all(lp <= 0 and len(top) == 2 for lp, top in a.logprobs)
    c = llm.generate("Once upon a time", SamplingParams(temperature=1.0, max_tokens=8, seed=43, ignore_eos=True))[0]
    assert c.token_ids != a.token_ids


@pytest.mark.slow
def test_context_limit_and_bad_input():
    small = LLM("default", max_model_len=20)
    out = small.generate("One two three four five", SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.prompt_token_ids) + len(out.token_ids) == 20
    with pytest.raises(ConfigError, match="empty"):
        small.generate([[]])
    with pytest.raises(ConfigError, match="unknown LLM option"):
        LLM("default", bogus=1)
    with pytest.raises(ConfigError, match="threads must be >= 1"):
        LLM("default", threads=0)
    with pytest.raises(ConfigError, match="encoder"):
        LLM("minilm")


# ---- CLI ------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_cli_generate(capsys):
    from scratchllm.cli.main import main

    assert main(["generate", "What is the capital of France?", "-n", "16"]) == 0
    captured = capsys.readouterr()
    assert "Paris" in captured.out and "tok/s" in captured.err
    assert main(["generate", "--raw", "Hello", "-n", "3", "--ignore-eos", "-t", "0.7", "--seed", "1", "-q"]) == 0
    assert main(["generate", "-m", "minilm", "hi"]) == 2
    assert "encoder" in capsys.readouterr().err


# ---- bench generate on a tiny model ----------------------------------------------------------------

def test_bench_generate_runs_and_counts_weight_bytes(tmp_path):
    from safetensors.numpy import save_file

    from scratchllm.bench import generate as bench

    C, I, V, KV = 32, 48, 64, 16
    rng = np.random.default_rng(0)
    shapes = {"model.embed_tokens.weight": (V, C), "model.norm.weight": (C,)}
    for i in range(2):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (C,), p + "post_attention_layernorm.weight": (C,),
                   p + "self_attn.q_proj.weight": (C, C), p + "self_attn.k_proj.weight": (KV, C),
                   p + "self_attn.v_proj.weight": (KV, C), p + "self_attn.o_proj.weight": (C, C),
                   p + "mlp.gate_proj.weight": (I, C), p + "mlp.up_proj.weight": (I, C),
                   p + "mlp.down_proj.weight": (C, I)}
    tensors = {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "vocab_size": V, "hidden_size": C, "intermediate_size": I,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
        "tie_word_embeddings": True}))
    args = argparse.Namespace(model=str(tmp_path), prompt_tokens=10, new_tokens=5, repeat=1, bandwidth_mb=8,
                              threads="1,2", dtype="float32", peer=None)
    result = bench.run(args)
    f = result["figures"]
    # tied: the embedding matrix is read once per token, as the LM head
    assert f["weight_mb_per_token"] * 1e6 == sum(t.nbytes for t in tensors.values())
    assert f["bound_tok_s"] == pytest.approx(max(f["bandwidth_gb_s"].values()) * 1e9 / (f["weight_mb_per_token"] * 1e6))
    assert f["prefill_tok_s"] > 0 and f["decode_tok_s"] > 0 and f["load_s"] > 0
    assert result["ratios"]["decode_vs_bound"] == pytest.approx(f["decode_tok_s"] / f["bound_tok_s"])
    assert "bound" in bench.render(result)
    assert result["peer"] is None and "llama.cpp not measured" in bench.render(result)  # no figures from elsewhere
    json.dumps(result, default=str)
    # --peer llama.cpp: the peer must be installed, and runs on GGUF files only
    from scratchllm.bench import peers
    from scratchllm.errors import ConfigError

    with pytest.raises(ConfigError, match="GGUF file" if peers.peer_installed() else "make peers"):
        bench.run(argparse.Namespace(**{**vars(args), "peer": "llama.cpp"}))
    assert set(f["by_threads"]) == {1, 2}
    assert all(t["blas_threads"] in (n, None) for n, t in f["by_threads"].items())  # None: no OpenBLAS found


def test_blas_threads_knob():
    threadpoolctl = pytest.importorskip("threadpoolctl")
    pytest.importorskip("scipy.linalg")  # maps a second OpenBLAS copy: the knob must still find NumPy's
    from scratchllm.models.threads import blas_threads, get_blas_threads

    before = get_blas_threads()
    if before is None:
        pytest.skip("NumPy is not linked against OpenBLAS here")
    with blas_threads(1) as n:
        assert n == 1
        numpys = [i for i in threadpoolctl.threadpool_info() if "numpy" in i["filepath"]]  # not SciPy's, torch's
        assert [i["num_threads"] for i in numpys] == [1]
    assert get_blas_threads() == before
