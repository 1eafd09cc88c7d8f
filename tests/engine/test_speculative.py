"""Speculative decoding in the engine: drafted tokens verified in the step's one packed forward,
beside other requests' prefills and decodes. Greedy output is token-identical to decoding without
speculation (both methods, batched, preempted, forked, with the prefix cache), seeded n-gram
sampling too; sampled output with a draft model follows the target's distribution (chi-square
through the engine, alpha = 0.001); the paged pool's invariants hold after every step and
rejected drafts' blocks go back."""

import itertools

import numpy as np
import pytest
from scipy.stats import chisquare

from scratchllm.engine import EngineConfig, LLMEngine
from scratchllm.engine.paged_attention import PagedSequence
from scratchllm.errors import ConfigError
from scratchllm.sampling import SamplingParams, filtered_probs

from .tiny import greedy_alone, tiny_llama

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "adaptive": False}
DRAFT = {"model": "tiny", "num_speculative_tokens": 3, "adaptive": False}


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=1)


def prompts():
    rng = np.random.default_rng(0)
    base = rng.integers(1, 97, 20).tolist()
    return [base * 3, rng.integers(1, 97, 30).tolist(), base[:7] * 5, rng.integers(1, 97, 9).tolist() * 4]


def engine(model, spec=None, draft=None, **options):
    options.setdefault("num_kv_blocks", 128)
    options.setdefault("block_size", 4)
    return LLMEngine(model, EngineConfig(speculative_config=spec, **options), draft_model=draft)


def run_checked(eng, prompt_list, params, arrive_every=0):
    """Run to completion, checking the block manager's invariants after every step; requests
    arrive one every `arrive_every` steps (0: all at once). Returns the outputs (in prompt
    order) and the batches the scheduler made."""
    batches = []
    schedule = eng.scheduler.schedule

    def recording(*args, **kwargs):
        batch = schedule(*args, **kwargs)
        batches.append([(r, n, r in batch.drafts) for r, n in batch.items])
        return batch

    eng.scheduler.schedule = recording
    outs, pending, steps = {}, list(enumerate(prompt_list)), 0
    while pending or eng.has_work():
        if pending and (arrive_every == 0 or steps % arrive_every == 0):
            for i, p in pending[: None if arrive_every == 0 else 1]:
                outs[eng.add_request(f"r{i}", p, params[i] if isinstance(params, list) else params).request_id] = []
            pending = [] if arrive_every == 0 else pending[1:]
        for event in eng.step():
            if event.token_id is not None:
                outs[event.request_id].append(event.token_id)
        eng.block_manager.check(eng.requests.values())
        steps += 1
    assert eng.block_manager.num_used == 0, "every block goes back"
    return [outs[f"r{i}"] for i in range(len(prompt_list))], batches


def test_verifying_k_rows_gives_the_logits_of_k_single_steps(model):
    """A verification row computes what a one-row step at its position computes, bit for bit:
    the forward works row by row and the paged attention reads exactly positions 0..p."""
    prompt = list(range(3, 30))
    for kv in ("float32", "float16", "bfloat16"):
        single = PagedSequence(model.config, 128, kv_dtype=kv)
        logits = model.forward(np.array(prompt), np.arange(len(prompt)), single, logits_rows=[len(prompt) - 1])
        tokens, rows = [], []
        for i in range(6):
            tokens.append(int(np.argmax(logits[-1])))
            logits = model.forward(np.array(tokens[-1:]), np.array([len(prompt) + i]), single)
            rows.append(logits[0])
        batched = PagedSequence(model.config, 128, kv_dtype=kv)
        model.forward(np.array(prompt), np.arange(len(prompt)), batched, logits_rows=[len(prompt) - 1])
        verify = model.forward(np.array(tokens), np.arange(len(prompt), len(prompt) + 6), batched)
        assert all(np.array_equal(a, b) for a, b in zip(rows, verify, strict=True)), kv


@pytest.mark.parametrize("method", ["ngram", "draft"])
@pytest.mark.parametrize("arrive_every", [0, 3])
def test_greedy_is_token_identical_to_no_speculation(model, method, arrive_every):
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    plain, _ = run_checked(engine(model), prompts(), params, arrive_every)
    spec = NGRAM if method == "ngram" else DRAFT
    draft = tiny_llama(seed=1) if method == "draft" else None  # the target's twin: every draft accepted
    eng = engine(model, spec, draft)
    got, batches = run_checked(eng, prompts(), params, arrive_every)
    assert got == plain
    assert [greedy_alone(model, p, 40) for p in prompts()] == plain
    stats = eng.stats()
    assert stats.spec_decode_num_drafts > 0 and stats.spec_decode_num_accepted_tokens > 0
    assert stats.spec_decode_num_emitted_tokens == stats.spec_decode_num_accepted_tokens + stats.spec_decode_num_drafts
    if arrive_every:  # drafts verified in the same forward as another request's prefill
        assert any(any(d for _, _, d in b) and any(n > 1 and not d for _, n, d in b) for b in batches)


def test_a_draft_model_that_disagrees_is_rejected_and_still_exact(model):
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    plain, _ = run_checked(engine(model), prompts(), params)
    eng = engine(model, DRAFT, tiny_llama(seed=2))
    got, _ = run_checked(eng, prompts(), params)
    s = eng.stats()
    assert got == plain and 0 < s.spec_decode_num_accepted_tokens < s.spec_decode_num_draft_tokens


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_exact_under_preemption_and_with_the_prefix_cache(model, method):
    """A pool too small for all requests at once: requests are preempted and recomputed; then the
    same prompts again, their prefixes from the cache. Outputs stay those without speculation."""
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    plain, _ = run_checked(engine(model, num_kv_blocks=40), prompts(), params)
    eng = engine(model, NGRAM if method == "ngram" else DRAFT, tiny_llama(seed=1) if method == "draft" else None,
                 num_kv_blocks=40)
    first, _ = run_checked(eng, prompts(), params)
    assert eng.scheduler.num_preemptions > 0
    again, _ = run_checked(eng, prompts(), params)
    assert first == again == plain and eng.block_manager.stats.prefix_hits > 0


def test_seeded_sampling_with_ngram_equals_without(model):
    """An n-gram draft is a point mass: verified by drawing from p with the request's generator,
    it spends the same random numbers as decoding without it, so a seed gives the same tokens."""
    params = [SamplingParams(max_tokens=30, temperature=0.9, top_k=20, seed=s) for s in range(4)]
    plain = engine(model).generate(prompts(), params)
    eng = engine(model, NGRAM)
    got = eng.generate(prompts(), params)
    assert [o.token_ids for o in got] == [o.token_ids for o in plain]
    assert eng.stats().spec_decode_num_drafts > 0


def test_forked_choices_speculate_and_equal_their_own_requests(model):
    eng = engine(model, NGRAM)
    prompt = prompts()[0]
    params = [SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=20, temperature=0.8, seed=3)]
    reqs = eng.add_group(["a", "b"], prompt, params)
    outs = {r.request_id: [] for r in reqs}
    while eng.has_work():
        for e in eng.step():
            outs[e.request_id].append(e.token_id)
        eng.block_manager.check(eng.requests.values())
    alone = engine(model).generate([prompt, prompt], params)
    assert [outs["a"], outs["b"]] == [o.token_ids for o in alone]


def test_the_batch_size_switch_and_the_token_budget(model):
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (5, 8, 30, 30)]
    off = dict(NGRAM, disable_by_batch_size=3)
    eng = engine(model, off)
    got, batches = run_checked(eng, prompts(), params)
    decodes = [b for b in batches if all(n == 1 or d for _, n, d in b)]
    assert all(not any(d for _, _, d in b) for b in decodes if len(b) >= 3)  # 3 or more decoding: no drafts
    assert eng.speculator.counters.steps_disabled > 0 and eng.stats().spec_decode_num_drafts > 0
    # a budget of 6 tokens a step: the drafts are cut to fit beside the other decodes
    tight = engine(model, NGRAM, max_num_batched_tokens=6)
    got2, batches2 = run_checked(tight, prompts(), params)
    assert got2 == got and max(sum(n for _, n, _ in b) for b in batches2) <= 6


def test_adaptive_draft_length_stops_drafting_what_is_rejected(model):
    """Random prompts give n-gram drafts that are rejected: the rule stops drafting them (at a
    fixed cost of a row, a third of the step's fixed part, rather than the time measured)."""
    from scratchllm.engine.speculative.draft_length import StepCost

    rng = np.random.default_rng(5)
    ps = [rng.integers(1, 97, 40).tolist() for _ in range(2)]
    eng = engine(model, dict(NGRAM, adaptive=True))
    eng.speculator.cost = lambda: StepCost(1.0, 0.33)
    eng.generate(ps, SamplingParams(max_tokens=60, temperature=1.0, seed=0))
    s = eng.stats()
    forced = engine(model, NGRAM)
    forced.generate(ps, SamplingParams(max_tokens=60, temperature=1.0, seed=0))
    assert s.spec_decode_num_draft_tokens < forced.stats().spec_decode_num_draft_tokens


def test_a_draft_model_of_another_vocabulary_is_refused(model):
    with pytest.raises(ConfigError, match="logits over 50 token ids, the target's over 97"):
        engine(model, DRAFT, tiny_llama(seed=1, vocab=50))


def test_the_memory_plan_holds_the_draft(model):
    eng = engine(model, DRAFT, tiny_llama(seed=2))
    plan = eng.plan
    assert plan.draft_weights_bytes > 0 and plan.num_draft_blocks >= plan.num_kv_blocks
    assert plan.total_bytes > plan.weights_bytes + plan.kv_bytes + plan.activation_bytes
    assert "draft model" in plan.describe()


# ---- the distribution through the engine -------------------------------------------------------
V, ALPHA, N = 4, 0.001, 3000  # a 4-token vocabulary, the significance level, requests


def exact_three(target, prompt, params):
    """The target's probability of each 3-token continuation: its filtered distributions after
    the prompt and each continuation so far (as the sampling path draws them)."""
    def dist(tokens):
        cache = PagedSequence(target.config, 64)
        logits = target.forward(np.array(tokens), np.arange(len(tokens)), cache, logits_rows=[len(tokens) - 1])
        return filtered_probs(logits[-1], params)

    out = {}
    p1 = dist(prompt)
    for a in range(V):
        p2 = dist(prompt + [a])
        for b in range(V):
            p3 = dist(prompt + [a, b])
            for c in range(V):
                out[(a, b, c)] = p1[a] * p2[b] * p3[c]
    return out


def sample_three(target, draft, prompt, params, seeds):
    eng = engine(target, {"model": "d", "num_speculative_tokens": 2, "adaptive": False, "disable_by_batch_size": None},
                 draft,
                 num_kv_blocks=2048, max_num_seqs=256, max_num_batched_tokens=4096)
    outs = eng.generate([prompt] * len(seeds), [SamplingParams(**{**params, "seed": s}) for s in seeds])
    assert eng.stats().spec_decode_num_drafts >= len(seeds) // 2
    counts = dict.fromkeys(itertools.product(range(V), repeat=3), 0)
    for o in outs:
        counts[tuple(o.token_ids)] += 1
    return counts


def p_value(counts, probs):
    keys = list(probs)
    observed = np.array([counts[k] for k in keys], dtype=np.float64)
    expected = np.array([probs[k] for k in keys]) * observed.sum()
    keep = expected >= 5  # the chi-square approximation's rule; the rest pooled into one cell
    obs = np.append(observed[keep], observed[~keep].sum())
    exp = np.append(expected[keep], expected[~keep].sum())
    return chisquare(obs, exp).pvalue


@pytest.fixture(scope="module")
def pair():
    return tiny_llama(seed=11, vocab=V), tiny_llama(seed=12, vocab=V)


PARAMS = {"max_tokens": 3, "temperature": 1.3, "ignore_eos": True}


def test_sampling_with_a_draft_model_keeps_the_target_distribution(pair):
    target, draft = pair
    prompt = [1, 3, 0, 2]
    probs = exact_three(target, prompt, SamplingParams(**PARAMS))
    assert p_value(sample_three(target, draft, prompt, PARAMS, range(N)), probs) > ALPHA


def test_a_biased_acceptance_rule_fails_the_same_test(pair, monkeypatch):
    """On rejection, draw from p instead of the residual: the engine's output is then off the
    target's distribution, and the test says so."""
    from scratchllm.engine import sampler
    from scratchllm.sampling import draw

    def biased(p, d, q, rng):
        if rng.random() * q[d] / q.sum() < p[d] / p.sum():
            return d, True
        return draw(p, rng), False

    monkeypatch.setattr(sampler, "accept_draft", biased)
    target, draft = pair
    prompt = [1, 3, 0, 2]
    probs = exact_three(target, prompt, SamplingParams(**PARAMS))
    assert p_value(sample_three(target, draft, prompt, PARAMS, range(N)), probs) < ALPHA


def test_a_grammar_constrains_the_drafts(caplog):
    """JSON-schema output over a byte vocabulary: n-gram drafts (repeats of the prompt's JSON) are
    verified against the grammar's mask row by row (a draft the grammar forbids is rejected); the
    output equals decoding without drafts, greedy and seeded, and matches the schema; the matcher
    is never handed a token it refuses."""
    import json

    import jsonschema

    from scratchllm.engine.fake import BYTE_TOKENS, FakeTokenizer
    from scratchllm.structured import GrammarCompiler

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "size": {"enum": ["S", "M", "L"]}},
              "required": ["ok", "size"], "additionalProperties": False}
    tok = FakeTokenizer(BYTE_TOKENS)
    grammar = GrammarCompiler(tok).json_schema(schema)
    target = tiny_llama(seed=7, vocab=BYTE_TOKENS)
    prompt = tok.encode('{"ok": true, "size": "M"} {"ok": false, "size": "L"} {"ok":')
    params = [SamplingParams(max_tokens=40, temperature=0.0, grammar=grammar),
              SamplingParams(max_tokens=40, temperature=0.7, seed=1, grammar=grammar)]
    plain = LLMEngine(target, EngineConfig(num_kv_blocks=64), tokenizer=tok).generate([prompt, prompt], params)
    eng = LLMEngine(target, EngineConfig(num_kv_blocks=64, speculative_config=NGRAM), tokenizer=tok)
    with caplog.at_level("WARNING"):
        got = eng.generate([prompt, prompt], params)
    assert [o.token_ids for o in got] == [o.token_ids for o in plain]
    assert eng.stats().spec_decode_num_drafts > 0
    for o in got:
        jsonschema.validate(json.loads(tok.decode(o.token_ids[:-1])), schema)
    assert "grammar rejected token" not in caplog.text


def test_a_draft_ends_at_its_first_end_token():
    """Nothing after an end token is ever emitted: the draft is cut there (the model's tokens
    that end generation unless the request ignores them, and its stop tokens)."""
    from scratchllm.engine.request import Request
    from scratchllm.engine.speculative.config import SpeculativeConfig
    from scratchllm.engine.speculative.draft import Draft
    from scratchllm.engine.speculative.speculator import Speculator

    spec = Speculator(SpeculativeConfig(**NGRAM), 512, end_token_ids={2, 9})

    def cut(tokens, **params):
        req = Request("r", [1], SamplingParams(max_tokens=10, **params), None)
        return spec._to_end(req, Draft(tokens)).tokens

    assert cut([5, 2, 7, 8]) == [5, 2]
    assert cut([5, 9, 7, 8]) == [5, 9]  # any token that ends generation, not the EOS alone
    assert cut([5, 2, 7, 8], ignore_eos=True) == [5, 2, 7, 8]
    assert cut([5, 6, 7, 8], stop_token_ids=(7,)) == [5, 6, 7]
