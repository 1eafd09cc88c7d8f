"""The prompt's logprobs (SamplingParams.prompt_logprobs) equal the log-softmax of one full
forward over the prompt, however the prefill is chunked, preempted, forked or served from the
prefix cache; and requests that do not ask keep none."""

import dataclasses

import numpy as np
import pytest

from scratchllm.engine import EngineConfig, LLMEngine
from scratchllm.engine.static import StaticEngine
from scratchllm.errors import ConfigError
from scratchllm.models import ContiguousKVCache
from scratchllm.sampling import SamplingParams, log_softmax

from .tiny import tiny_llama

PROMPT = [int(t) for t in np.random.default_rng(3).integers(0, 97, 45)]
EXACT = {"kv_cache_dtype": "float32"}  # the reference forward's own float32 K/V


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=5)


def reference(model, prompt, k):
    """[(logprob, rank, top k)] of prompt tokens 1.. from one forward over the whole prompt."""
    logits = model.forward(np.array(prompt), np.arange(len(prompt)), ContiguousKVCache.for_model(model.config,
                                                                                                len(prompt)))
    out = []
    for p in range(len(prompt) - 1):
        lp = log_softmax(logits[p])
        token = prompt[p + 1]
        top = np.argsort(-lp, kind="stable")[:k]
        out.append((lp[token], 1 + int((lp > lp[token]).sum()), [(int(i), lp[i]) for i in top]))
    return out


def check(got, want):
    assert len(got) == len(want)
    for (lp, rank, top), (w_lp, w_rank, w_top) in zip(got, want, strict=True):
        assert abs(lp - w_lp) < 1e-4 and rank == w_rank
        assert [t for t, _ in top] == [t for t, _ in w_top]
        np.testing.assert_allclose([v for _, v in top], [v for _, v in w_top], atol=1e-4)


@pytest.mark.parametrize("budget", [512, 16, 7])  # one chunk; chunks of 16 and of 7 tokens
def test_prompt_logprobs_equal_a_full_forward(model, budget):
    engine = LLMEngine(model, EngineConfig(max_num_batched_tokens=budget, num_kv_blocks=64, **EXACT))
    plain, asked = engine.generate([PROMPT, PROMPT[:20]], [SamplingParams(max_tokens=3, temperature=0),
                                                           SamplingParams(max_tokens=3, temperature=0,
                                                                          prompt_logprobs=2)])
    assert plain.prompt_logprobs is None
    check(asked.prompt_logprobs, reference(model, PROMPT[:20], 2))
    (again,) = engine.generate([PROMPT], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=0))
    check(again.prompt_logprobs, reference(model, PROMPT, 0))  # its blocks were in the prefix cache


def test_n_choices_share_the_prompt_logprobs(model):
    engine = LLMEngine(model, EngineConfig(num_kv_blocks=64, **EXACT))
    params = [SamplingParams(max_tokens=2, temperature=1.0, seed=s, prompt_logprobs=1) for s in range(3)]
    reqs = engine.add_group([None, None, None], PROMPT, params)
    firsts = {}
    while engine.has_work():
        for event in engine.step():
            if event.index == 0:
                firsts[event.request_id] = event.prompt_logprobs
    want = reference(model, PROMPT, 1)
    for r in reqs:
        check(firsts[r.request_id], want)


def test_a_preempted_request_keeps_its_prompt_logprobs_once(model):
    # 3 blocks of 16: two requests cannot both grow, so one is preempted and recomputed
    engine = LLMEngine(model, EngineConfig(num_kv_blocks=5, max_num_batched_tokens=16, enable_prefix_caching=False,
                                           **EXACT))
    p = SamplingParams(max_tokens=30, temperature=0, prompt_logprobs=0, ignore_eos=True)
    outs = engine.generate([PROMPT[:30], PROMPT[5:35]], [p, dataclasses.replace(p)])
    assert engine.scheduler.num_preemptions > 0
    check(outs[0].prompt_logprobs, reference(model, PROMPT[:30], 0))
    check(outs[1].prompt_logprobs, reference(model, PROMPT[5:35], 0))


def test_params_and_engines_that_cannot():
    with pytest.raises(ConfigError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)
    from scratchllm.engine.fake import FakeTokenizer

    engine = StaticEngine(tiny_llama(seed=1), FakeTokenizer(), batch_size=1, max_model_len=64)
    try:
        with pytest.raises(ConfigError, match="prompt"):
            engine.submit([1, 2, 3], SamplingParams(prompt_logprobs=0))
    finally:
        engine.shutdown()
