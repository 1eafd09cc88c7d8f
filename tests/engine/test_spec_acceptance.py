"""The acceptance rules of speculative decoding. Greedy: exactly the target's argmax tokens.
Sampled: the emitted tokens follow the target's distribution, shown by a chi-square test on a
target and a draft whose next-token distributions are known exactly (two Markov chains over 4
tokens), at significance level alpha = 0.001 with a fixed seed; a deliberately biased rule (on
rejection, draw from p instead of the residual max(0, p - q)) fails the same test."""

import itertools

import numpy as np
import pytest
from scipy.stats import chisquare

from scratchllm.engine.speculative.acceptance import (
    accept_draft,
    greedy_accepted,
    greedy_verify,
    residual,
    speculative_sample,
)
from scratchllm.sampling import SamplingParams, draw, sample_token

ALPHA = 0.001  # the test's significance level: a correct rule fails it one run in a thousand seeds
V, T, K, N = 4, 3, 2, 15000  # vocabulary, tokens per sample, drafts per step, samples


def chain(seed, floor):
    """A Markov chain [V, V]: row a is the next-token distribution after token a, every entry
    at least `floor` (so every 3-token sequence expects at least 5 samples at N)."""
    rng = np.random.default_rng(seed)
    m = rng.dirichlet(np.ones(V), size=V)
    return floor + (1 - V * floor) * m


P = chain(1, 0.08)  # the target
Q = chain(2, 0.02)  # the draft: a different chain
START = 0


def exact():
    """The target's probability of each sequence of T tokens after START."""
    out = {}
    for seq in itertools.product(range(V), repeat=T):
        prob, prev = 1.0, START
        for t in seq:
            prob *= P[prev, t]
            prev = t
        out[seq] = prob
    return out


def generate(rule, rng, point_mass):
    """T tokens by speculative decoding: K drafts per step (drawn from Q, or Q's argmax as a point
    mass), the target's K + 1 rows, `rule` picks what is emitted."""
    seq, out = [START], []
    while len(out) < T:
        drafts, q_rows, ctx = [], [], seq[-1]
        for _ in range(K):
            d = int(np.argmax(Q[ctx])) if point_mass else draw(Q[ctx], rng)
            drafts.append(d)
            q_rows.append(Q[ctx])
            ctx = d
        p_rows = [P[seq[-1]]] + [P[d] for d in drafts]
        tokens = rule(p_rows, drafts, None if point_mass else q_rows, rng)
        seq += tokens
        out += tokens
    return tuple(out[:T])


def biased(p_rows, drafts, q_rows, rng):
    """The classic mistake: on rejection, draw from p itself rather than the residual."""
    out = []
    for i, d in enumerate(drafts):
        q = q_rows[i] if q_rows is not None else np.eye(V)[d]
        if rng.random() < min(1.0, p_rows[i][d] / q[d]):
            out.append(d)
            continue
        out.append(draw(p_rows[i], rng))
        return out
    return out + [draw(p_rows[-1], rng)]


def p_value(rule, point_mass, seed=0):
    rng = np.random.default_rng(seed)
    counts = dict.fromkeys(itertools.product(range(V), repeat=T), 0)
    for _ in range(N):
        counts[generate(rule, rng, point_mass)] += 1
    probs = exact()
    observed = np.array([counts[s] for s in probs], dtype=np.float64)
    expected = np.array([probs[s] * N for s in probs])
    assert expected.min() >= 5, "every cell expects enough samples for the chi-square approximation"
    return chisquare(observed, expected).pvalue


@pytest.mark.parametrize("point_mass", [False, True], ids=["draft-distribution", "point-mass-draft"])
def test_speculative_sampling_keeps_the_target_distribution(point_mass):
    assert p_value(speculative_sample, point_mass) > ALPHA


@pytest.mark.parametrize("point_mass", [False, True], ids=["draft-distribution", "point-mass-draft"])
def test_a_biased_rule_fails_the_same_test(point_mass):
    assert p_value(biased, point_mass) < ALPHA


def test_greedy_verify_is_the_targets_argmax():
    assert greedy_accepted([5, 6, 7], [5, 6]) == 2 and greedy_verify([5, 6, 7], [5, 6]) == [5, 6, 7]
    assert greedy_verify([5, 9, 7], [5, 6]) == [5, 9]
    assert greedy_verify([4, 6, 7], [5, 6]) == [4]
    assert greedy_verify([3], []) == [3]


def test_point_mass_spends_the_rng_like_plain_sampling():
    # the same seed: the tokens drawn through accept_draft equal sample_token's, draft or no draft
    params = SamplingParams(temperature=0.7, top_k=3, seed=11)
    logits = np.random.default_rng(3).standard_normal((40, 50)).astype(np.float32)
    plain_rng, spec_rng = np.random.default_rng(11), np.random.default_rng(11)
    from scratchllm.sampling import filtered_probs

    for row in logits:
        plain = sample_token(row, params, plain_rng)
        guess = int(np.argmax(row))
        token, ok = accept_draft(filtered_probs(row, params), guess, None, spec_rng)
        assert token == plain and ok == (plain == guess)


def test_accept_and_residual():
    p, q = np.array([0.5, 0.3, 0.2]), np.array([0.2, 0.6, 0.2])
    assert np.allclose(residual(p, q), [0.3, 0.0, 0.0])
    rng = np.random.default_rng(0)
    # p(0) >= q(0): always accepted
    assert all(accept_draft(p, 0, q, rng) == (0, True) for _ in range(100))
    # token 1: accepted half the time (0.3 / 0.6); a rejection can only give token 0
    results = [accept_draft(p, 1, q, rng) for _ in range(4000)]
    assert {t for t, ok in results if not ok} == {0}
    assert abs(np.mean([ok for _, ok in results]) - 0.5) < 0.04
