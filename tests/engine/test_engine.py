"""The engine loop on tiny random Llamas: continuous batching, chunked prefill and preemption do
not change a single greedy token; aborts return every block; stop rules; the memory plan."""

import numpy as np
import pytest

from scratchllm.engine import EngineConfig, LLMEngine
from scratchllm.errors import ConfigError, MemoryPlanError
from scratchllm.sampling import SamplingParams

from .tiny import greedy_alone, tiny_llama


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=3)


def run_all(engine, prompts, max_tokens, params=None):
    for i, (p, m) in enumerate(zip(prompts, max_tokens, strict=True)):
        engine.add_request(str(i), p, params or SamplingParams(max_tokens=m, temperature=0.0))
    out = {str(i): [] for i in range(len(prompts))}
    reasons = {}
    while engine.has_work():
        for o in engine.step():
            out[o.request_id].append(o.token_id)
            if o.finish_reason:
                reasons[o.request_id] = o.finish_reason
    return [out[str(i)] for i in range(len(prompts))], reasons


def workload(n=32, seed=0, vocab=97):
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, vocab, int(rng.integers(1, 60))).tolist() for _ in range(n)]
    max_tokens = [int(rng.integers(1, 40)) for _ in range(n)]
    return prompts, max_tokens


def test_one_request_equals_the_plain_loop(model):
    prompt = [5, 9, 11, 2, 40, 41, 42, 7, 1, 3, 3, 3, 8, 60, 61, 62, 63, 20]
    # the float32 KV cache: the exact path, token for token with the plain float32 loop
    got, _ = run_all(LLMEngine(model, EngineConfig(num_kv_blocks=16, kv_cache_dtype="float32")), [prompt], [30])
    assert got[0] == greedy_alone(model, prompt, 30)


@pytest.mark.parametrize("kv_blocks,budget", [(256, 512), (256, 24), (26, 64)],
                         ids=["roomy", "chunked-prefill", "tiny-pool-preempts"])
def test_batch_invariance_32_mixed_requests(model, kv_blocks, budget):
    prompts, max_tokens = workload()
    want = [greedy_alone(model, p, m) for p, m in zip(prompts, max_tokens, strict=True)]
    engine = LLMEngine(model, EngineConfig(num_kv_blocks=kv_blocks, max_num_batched_tokens=budget, block_size=4,
                                           kv_cache_dtype="float32"))  # the plain loop's float32 K/V
    got, reasons = run_all(engine, prompts, max_tokens)
    assert got == want
    assert set(reasons.values()) == {"length"}
    stats = engine.stats()
    assert stats.kv_blocks_used == 0 and stats.running == 0 and stats.waiting == 0
    if kv_blocks == 26:
        assert stats.preemptions > 0  # the tiny pool really forced recompute
    if budget == 24:
        assert stats.steps > sum(-(-len(p) // 24) for p in prompts) / 32  # prompts were chunked
    engine.block_manager.check([])


def test_prefix_cache_hits_and_same_output(model):
    shared = list(range(10, 50))
    prompts = [shared + [1, 2], shared + [3], shared + [4, 5, 6]]
    engine = LLMEngine(model, EngineConfig(num_kv_blocks=64, block_size=4))
    got, _ = run_all(engine, prompts[:1], [5])
    got2, _ = run_all(engine, prompts[1:], [5, 5])
    assert engine.stats().prefix_cache_hits >= 2 * (len(shared) // 4)
    assert [got[0]] + got2 == [greedy_alone(model, p, 5) for p in prompts]


def test_abort_returns_all_blocks(model):
    engine = LLMEngine(model, EngineConfig(num_kv_blocks=64, block_size=4))
    prompts, _ = workload(6, seed=1)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=50, temperature=0.0))
    for _ in range(3):
        engine.step()
    assert engine.block_manager.num_used > 0
    finals = [engine.abort(f"r{i}") for i in range(6)]
    assert all(f.finish_reason == "abort" for f in finals)
    assert engine.block_manager.num_used == 0 and not engine.has_work()
    assert engine.abort("r0") is None  # twice is harmless
    engine.block_manager.check([])


def test_abort_while_waiting(model):
    engine = LLMEngine(model, EngineConfig(num_kv_blocks=64))
    engine.add_request("w", [1, 2, 3], SamplingParams(max_tokens=5))
    assert engine.abort("w").finish_reason == "abort"
    assert not engine.has_work()


def test_eos_and_stop_token_ids(model):
    prompt = [1, 2, 3, 4]
    alone = greedy_alone(model, prompt, 10)
    stop = alone[4]
    engine = LLMEngine(model, EngineConfig(num_kv_blocks=16))
    got, reasons = run_all(engine, [prompt], [10], SamplingParams(max_tokens=10, temperature=0.0,
                                                                   stop_token_ids=(stop,)))
    assert got[0] == alone[: alone.index(stop) + 1] and reasons["0"] == "stop"
    engine = LLMEngine(model, EngineConfig(num_kv_blocks=16), eos_token_id=stop)
    got, _ = run_all(engine, [prompt], [10], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    assert got[0] == alone


def test_seeded_sampling_is_batch_invariant(model):
    prompts, _ = workload(8, seed=2)
    params = SamplingParams(max_tokens=12, temperature=0.8, top_k=20, seed=7)
    alone = [run_all(LLMEngine(model, EngineConfig(num_kv_blocks=64)), [p], [12], params)[0][0] for p in prompts]
    together, _ = run_all(LLMEngine(model, EngineConfig(num_kv_blocks=64)), prompts, [12] * 8, params)
    assert together == alone


def test_metrics_timestamps_are_ordered(model):
    engine = LLMEngine(model, EngineConfig(num_kv_blocks=16))
    engine.add_request("m", [1, 2, 3], SamplingParams(max_tokens=4, temperature=0.0))
    last = None
    while engine.has_work():
        for o in engine.step():
            last = o
    m = last.metrics
    assert m.arrival <= m.first_scheduled <= m.first_token <= m.finished
    assert m.prompt_tokens == 3 and m.completion_tokens == 4 and m.queue_ms >= 0


def test_bad_requests_are_refused(model):
    engine = LLMEngine(model, EngineConfig(num_kv_blocks=8, block_size=4))  # context capped at 32
    with pytest.raises(ConfigError, match="context"):
        engine.add_request("long", list(range(40)), SamplingParams())
    with pytest.raises(ConfigError):
        engine.add_request("oov", [1000], SamplingParams())
    engine.add_request("x", [1], SamplingParams())
    with pytest.raises(ConfigError, match="in use"):
        engine.add_request("x", [1], SamplingParams())


def test_memory_plan_refuses_at_start_with_numbers(model):
    with pytest.raises(MemoryPlanError, match=r"weights .* MiB .* KV pool .*per token\) 100000 blocks .*budget"):
        LLMEngine(model, EngineConfig(num_kv_blocks=100_000, memory_budget_bytes=64 << 20))
    engine = LLMEngine(model, EngineConfig(memory_budget_bytes=64 << 20))
    plan = engine.plan
    assert plan.total_bytes <= 64 << 20 and plan.num_kv_blocks > 0


def test_memory_plan_counts_the_packed_matrices(model):
    from scratchllm.engine.memory_plan import weights_bytes
    from scratchllm.models.packed import PackedWeight

    matrices = [w for layer in model.params.layers for w in layer.matrices().values() if isinstance(w, PackedWeight)]
    matrices.append(model.params.lm_head)
    assert weights_bytes(model) >= sum(w.nbytes for w in matrices) > 0


def test_generate_reports_logprobs_of_the_forward(model):
    from scratchllm.models import ContiguousKVCache
    from scratchllm.sampling import top_logprobs

    engine = LLMEngine(model, EngineConfig(num_kv_blocks=16, kv_cache_dtype="float32"))  # the forward's own K/V
    (r,) = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=1, temperature=0.0, logprobs=3))
    logits = model.forward(np.array([1, 2, 3]), np.arange(3), ContiguousKVCache.for_model(model.config, 8))[-1]
    lp, top = top_logprobs(logits, r.token_ids[0], 3)
    got_lp, got_top = r.logprobs[0]
    assert got_lp == pytest.approx(lp, abs=1e-4)
    assert [t for t, _ in got_top] == [t for t, _ in top]


def test_priority_hook_and_adjustment_reach_the_scheduler(model):
    engine = LLMEngine(model, EngineConfig(num_kv_blocks=64, max_num_seqs=1))
    engine.set_priority_hook(lambda req: 0.5 if req.request_id == "b" else 0.0)
    for rid in ("a", "b", "c"):
        engine.add_request(rid, [1, 2, 3], SamplingParams(max_tokens=300, temperature=0.0))
    assert engine.requests["b"].priority_adjust_s == 0.5
    assert engine.adjust_priority("c", 1.0)
    engine.step()
    assert [r.request_id for r in engine.scheduler.running] == ["c"]  # c moved ahead of b and a
    assert not engine.adjust_priority("c", 0.0)  # running: nothing to move
