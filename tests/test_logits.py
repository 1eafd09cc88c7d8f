"""Logits processors against plain reference implementations of each stated rule (loops over
Python dicts, written from the rules' definitions), against transformers' own processors where
one exists, and end to end through the engine against a one-sequence reference loop."""

from collections import Counter

import numpy as np
import pytest

from scratchllm.engine import EngineConfig, LLMEngine
from scratchllm.errors import ConfigError
from scratchllm.logits import apply_processors, min_p_filter
from scratchllm.sampling import SamplingParams, filtered_probs, shaped_logits
from tests.engine.tiny import tiny_llama

V = 97


# --- references: one token at a time, straight from the rules' definitions ---------------------
def ref_repetition(logits, seen_ids, r):
    out = [float(x) for x in logits]
    for t in set(seen_ids):
        out[t] = out[t] / r if out[t] > 0 else out[t] * r
    return np.array(out, dtype=np.float32)


def ref_openai_penalties(logits, output_ids, frequency, presence):
    out = [float(x) for x in logits]
    for t, c in Counter(output_ids).items():
        out[t] = out[t] - c * frequency - (1.0 if c > 0 else 0.0) * presence
    return np.array(out, dtype=np.float32)


def ref_bias(logits, bias):
    out = [float(x) for x in logits]
    for t, b in bias.items():
        out[t] = float("-inf") if b == -100 else out[t] + b
    return np.array(out, dtype=np.float32)


def ref_min_p(p, min_p):
    top = max(p)
    return np.array([x if x >= min_p * top else 0.0 for x in p])


def ref_all(logits, prompt, output, params):
    """The documented order: repetition -> frequency/presence -> logit_bias."""
    x = ref_repetition(logits, prompt + output, params.repetition_penalty)
    x = ref_openai_penalties(x, output, params.frequency_penalty, params.presence_penalty)
    return ref_bias(x, dict(params.logit_bias))


def case(seed):
    rng = np.random.default_rng(seed)
    logits = (rng.standard_normal(V) * 3).astype(np.float32)
    prompt = rng.integers(0, V, 12).tolist()
    output = rng.integers(0, V, int(rng.integers(0, 30))).tolist()
    return logits, prompt, output


@pytest.mark.parametrize("seed", range(20))
def test_processors_match_reference(seed):
    logits, prompt, output = case(seed)
    rng = np.random.default_rng(100 + seed)
    bias = {int(t): float(rng.choice([-100.0, rng.uniform(-5, 5)])) for t in rng.integers(0, V, 5)}
    params = SamplingParams(repetition_penalty=float(rng.uniform(0.5, 2.0)),
                            frequency_penalty=float(rng.uniform(-2, 2)), presence_penalty=float(rng.uniform(-2, 2)),
                            logit_bias=bias)
    got = apply_processors(logits, params, prompt, output)
    np.testing.assert_allclose(got, ref_all(logits, prompt, output, params), rtol=1e-6, atol=1e-5)
    assert np.array_equal(logits, case(seed)[0]), "the runner's logits row must not be modified"


@pytest.mark.parametrize("seed", range(8))
def test_repetition_penalty_matches_transformers(seed):
    torch = pytest.importorskip("torch")
    from transformers import RepetitionPenaltyLogitsProcessor

    logits, prompt, output = case(seed)
    r = [1.3, 0.7, 2.0, 1.05][seed % 4]
    ids = torch.tensor([prompt + output])
    want = RepetitionPenaltyLogitsProcessor(penalty=r)(ids, torch.tensor(logits)[None].clone())[0].numpy()
    got = apply_processors(logits, SamplingParams(repetition_penalty=r), prompt, output)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("min_p,temperature", [(0.05, 1.0), (0.1, 0.7), (0.3, 1.5), (0.9, 1.0), (1.0, 1.0)])
def test_min_p_matches_transformers(min_p, temperature):
    torch = pytest.importorskip("torch")
    from transformers import MinPLogitsWarper

    logits, _, _ = case(7)
    scores = torch.tensor(logits, dtype=torch.float64)[None] / temperature
    warped = MinPLogitsWarper(min_p=min_p)(None, scores)[0]
    want = torch.softmax(warped, dim=-1).numpy()
    got = filtered_probs(logits, SamplingParams(temperature=temperature, min_p=min_p))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-9)


def test_min_p_filter_matches_reference():
    rng = np.random.default_rng(3)
    for _ in range(20):
        p = rng.dirichlet(np.full(V, 0.3))
        m = float(rng.uniform(0, 1))
        np.testing.assert_array_equal(min_p_filter(p, m), ref_min_p(p.tolist(), m))


def test_banned_token_never_drawn():
    logits, prompt, output = case(1)
    top = int(np.argmax(logits))
    params = SamplingParams(temperature=5.0, seed=0, logit_bias={top: -100})
    row = shaped_logits(logits, params, prompt, output)
    assert row[top] == -np.inf and filtered_probs(row, params)[top] == 0.0


def test_grammar_mask_outranks_bias_that_bans_everything_it_allows():
    logits, prompt, output = case(2)
    allowed = np.zeros(V, dtype=bool)
    allowed[[5, 9]] = True
    row = shaped_logits(logits, SamplingParams(logit_bias={5: -100, 9: -100}), prompt, output, allowed)
    assert np.isfinite(row[[5, 9]]).all() and np.isinf(np.delete(row, [5, 9])).all()


def test_extreme_accepted_values_keep_the_row_finite():
    """The smallest positive repetition penalty and temperature are accepted, so they must not
    overflow into inf or NaN (numpy warnings are errors here): a seen token with a positive logit
    becomes the largest finite value, and a near-zero temperature draws the argmax."""
    rng = np.random.default_rng(3)
    logits = rng.standard_normal(V).astype(np.float32)
    seen = int(np.argmax(np.where(logits > 0, logits, -np.inf)))
    row = apply_processors(logits, SamplingParams(repetition_penalty=5e-324), [seen], [])
    assert np.isfinite(row).all() and row[seen] == np.finfo(np.float32).max
    p = filtered_probs(logits, SamplingParams(temperature=5e-324))
    assert np.isfinite(p).all() and p[np.argmax(logits)] == 1.0


@pytest.mark.parametrize("kwargs,match", [
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"frequency_penalty": float("nan")}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": True}, "repetition_penalty"),
    ({"min_p": 1.5}, "min_p"),
    ({"min_p": "0.1"}, "min_p"),
    ({"logit_bias": {5: 101}}, r"logit_bias\[5\]"),
    ({"logit_bias": {-1: 1.0}}, "token ids >= 0"),
    ({"logit_bias": {"x": 1.0}}, "token ids >= 0"),
    ({"logit_bias": [(1, 2, 3)]}, "pairs"),
    ({"grammar": "{}"}, "CompiledGrammar"),
])
def test_bad_values_are_refused(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        SamplingParams(**kwargs)


def test_logit_bias_forms_and_vocab_check():
    p = SamplingParams(logit_bias={"7": 1.5, 3: -100})  # JSON object keys arrive as strings
    assert p.logit_bias == ((3, -100.0), (7, 1.5)) and p.uses_processors
    with pytest.raises(ConfigError, match="outside the vocabulary"):
        p.check_vocab(5)
    assert not SamplingParams(temperature=0.0, min_p=0.2).uses_processors  # min_p is a filter


# --- end to end through the engine --------------------------------------------------------------
@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=5, vocab=V)


def reference_loop(model, prompt, params, max_tokens):
    """Greedy with the reference rules applied, recomputing the whole sequence each step."""
    from scratchllm.models import ContiguousKVCache

    out = []
    for _ in range(max_tokens):
        ids = prompt + out
        cache = ContiguousKVCache.for_model(model.config, len(ids))
        logits = model.forward(np.array(ids), np.arange(len(ids)), cache, logits_rows=np.array([len(ids) - 1]))[-1]
        out.append(int(np.argmax(ref_all(logits, prompt, out, params))))
    return out


def run(model, prompts, params):
    engine = LLMEngine(model, EngineConfig(num_kv_blocks=64))
    return [r.token_ids for r in engine.generate(prompts, params)]


def test_engine_greedy_with_penalties_matches_reference_loop(model):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, V, 6).tolist() for _ in range(4)]
    params = [SamplingParams(max_tokens=10, temperature=0.0, repetition_penalty=1.5),
              SamplingParams(max_tokens=10, temperature=0.0, frequency_penalty=1.0, presence_penalty=0.5),
              SamplingParams(max_tokens=10, temperature=0.0, logit_bias={3: 4.0, 10: -100}),
              SamplingParams(max_tokens=10, temperature=0.0)]
    got = run(model, prompts, params)
    for p, sp, g in zip(prompts, params, got, strict=True):
        assert g == reference_loop(model, p, sp, 10)
    assert got[0] != run(model, [prompts[0]], SamplingParams(max_tokens=10, temperature=0.0))[0], \
        "the penalty must change this output, or the test shows nothing"


def test_seeded_penalised_sampling_is_reproducible_and_batch_invariant(model):
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, V, 5).tolist() for _ in range(5)]
    params = SamplingParams(max_tokens=12, temperature=0.9, seed=11, min_p=0.05, frequency_penalty=0.7,
                            repetition_penalty=1.2, logit_bias={4: -100})
    alone = [run(model, [p], params)[0] for p in prompts]
    assert run(model, prompts, params) == alone == [run(model, [p], params)[0] for p in prompts]
    assert all(4 not in a for a in alone)


def test_plain_rows_skip_the_processors(model, monkeypatch):
    import scratchllm.engine.sampler as runner

    def boom(*a, **k):
        raise AssertionError("a request without processors must not be shaped")

    monkeypatch.setattr(runner, "shaped_logits", boom)
    assert len(run(model, [[1, 2, 3]], SamplingParams(max_tokens=3, temperature=0.0))[0]) == 3
