"""Several models in one memory plan, made from their headers before any weights are read: the
weights estimate bounds what the loader really holds; an engine given its share plans the pool
that was planned; what does not fit together is refused at start, naming each model."""

import pytest

from scratchllm.cli.main import main
from scratchllm.engine.config import EngineConfig
from scratchllm.engine.engine import LLMEngine
from scratchllm.engine.memory_plan import MiB, weights_bytes
from scratchllm.engine.shared_memory_plan import estimated_weights_bytes, model_need, plan_models
from scratchllm.errors import MemoryPlanError
from scratchllm.formats import load_checkpoint
from scratchllm.models import load_model
from tests.models.test_loader import CONFIG, tiny_llama_tensors, write

BIG = 64 << 30  # a budget nothing here comes near


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    config = {**CONFIG, "max_position_embeddings": 256}
    return str(write(tmp_path_factory.mktemp("tiny") / "llama", tiny_llama_tensors(), config))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_weights_estimate_bounds_what_the_loader_holds(tiny, dtype):
    held = weights_bytes(load_model(tiny, dtype=dtype))
    estimate = estimated_weights_bytes(load_checkpoint(tiny), dtype)
    assert held <= estimate <= 1.02 * held + 1.1 * MiB  # a tiny model: the 1 MiB margin is most of it


def test_an_engine_given_its_share_plans_the_pool_that_was_planned(tiny):
    options = {"max_num_seqs": 4, "max_num_batched_tokens": 64}
    plan = plan_models([tiny, tiny], options, budget_bytes=BIG)
    need = plan.needs[1]
    assert need.task == "generate" and need.kv_bytes > 0 and need.max_len == 256
    engine = LLMEngine(load_model(tiny), EngineConfig(**plan.engine_options(need, options)))
    assert engine.plan.kv_bytes == need.kv_bytes and engine.plan.activation_bytes == need.activation_bytes
    assert engine.plan.total_bytes <= need.total_bytes == engine.plan.budget_bytes
    assert engine.max_model_len == need.max_len


def test_models_that_do_not_fit_together_are_refused_naming_each(tiny):
    one = model_need(tiny, {}, BIG)
    # room for the first model, not for all of the second
    budget = one.weights_bytes * 3 // 2 + (2 << 20)
    with pytest.raises(MemoryPlanError) as err:
        plan_models([tiny, tiny], {"kv_cache_memory_bytes": 1 << 20}, budget_bytes=budget)
    message = str(err.value)
    assert f"'{tiny}'" in message and "the models before it plan" in message and "--memory-budget" in message


def test_serve_refuses_at_start_what_does_not_fit(capsys):
    """The default model and MiniLM take about 445 MiB at these options; Gemma 3's weights alone
    (about 240 MiB in its panels) do not fit in what is left of 600 MiB. Refused before anything
    loads (headers are all it reads)."""
    assert main(["serve", "default", "minilm", "gemma3-270m", "--memory-budget", "600MiB", "--max-num-seqs", "4",
                 "--max-model-len", "1024", "--port", "0", "--trace", "none"]) == 2
    err = capsys.readouterr().err
    assert "the models do not fit in 600.0 MiB: model 'gemma3-270m': its weights alone" in err, err
    assert "the models before it plan 'default'" in err and "'minilm'" in err, err


@pytest.mark.slow
@pytest.mark.parametrize("ref", ["default", "minilm", "gemma3-270m"])
def test_the_estimate_bounds_the_real_models(ref):
    need = model_need(ref, {}, BIG)
    model = load_model(ref)
    assert weights_bytes(model) <= need.weights_bytes <= 1.12 * weights_bytes(model) + MiB


def test_a_default_context_shrinks_to_the_pool_an_asked_one_is_refused_naming_what_fits(tiny, monkeypatch):
    """An engine whose budget leaves a pool shorter than the model's context: by default it
    serves the context the pool holds (above the floor); asked for the full context, it refuses
    and names the --max-model-len that fits."""
    from scratchllm.engine import memory_plan

    monkeypatch.setattr(memory_plan, "MIN_DEFAULT_CONTEXT", 64)  # the tiny model's context is 256
    model = load_model(tiny)
    options = {"max_num_seqs": 2, "max_num_batched_tokens": 32}
    roomy = LLMEngine(model, EngineConfig(**options))
    block = roomy.plan.kv_block_bytes
    budget = roomy.plan.weights_bytes + roomy.plan.activation_bytes + 10 * block + block // 2  # 10 blocks of 16
    engine = LLMEngine(model, EngineConfig(**options, memory_budget_bytes=budget))
    assert engine.plan.num_kv_blocks == 10 and engine.max_model_len == 160
    choice = memory_plan.context_choice(256, None, engine.plan, 16)
    assert choice.used == 160 and "context 160 tokens, of the model's 256: what the KV pool" in choice.describe()
    with pytest.raises(MemoryPlanError, match="a 256-token context \\(--max-model-len\\) needs 16 KV blocks, but the "
                                              "memory plan leaves room for 10 \\(160 tokens\\): --max-model-len 160 "
                                              "fits"):
        LLMEngine(model, EngineConfig(**options, memory_budget_bytes=budget, max_model_len=256))
    small = budget - 7 * block  # 3 blocks: 48 tokens, below the floor
    with pytest.raises(MemoryPlanError, match="\\(the model's\\) needs 16 KV blocks.*room for 3 \\(48 tokens, below "
                                              "the 64 tokens a default context gets at the least\\)"):
        LLMEngine(model, EngineConfig(**options, memory_budget_bytes=small))


def test_a_context_asked_past_the_model_s_is_said_as_asked_and_used():
    need = model_need("default", {"max_model_len": 10**12}, BIG)
    assert need.max_len == need.context.used == 8192 and need.context.adjusted
    assert need.context.describe() == ("--max-model-len 1,000,000,000,000 asked, 8,192 used: the model's context "
                                       "length (its positions past it were never trained)")
    assert model_need("default", {}, BIG).context.describe() == "context 8,192 tokens (the model's)"


def test_models_that_fit_only_with_shorter_contexts_share_the_room_else_the_budget_that_fits_is_named():
    """Three generators whose default KV pools (up to 1 GiB each) do not fit beside each other
    in 1100 MiB: each pool gets a share, each context shrinks with it (not below 4,096 tokens),
    and the plan fits. Under what even the shortest contexts need, the refusal names the
    --memory-budget that fits, and that budget does."""
    refs = ["default", "gemma3-270m", "default"]
    budget = 1100 * MiB
    with pytest.raises(MemoryPlanError):  # the old way: the first models take their whole pools
        from scratchllm.engine.shared_memory_plan import _plan_in_order
        _plan_in_order(refs, {}, budget)
    plan = plan_models(refs, {}, budget)
    assert plan.total_bytes <= budget
    assert all(4096 <= n.max_len < 32768 for n in plan.needs if n.ref == "gemma3-270m")
    assert [n.context.used for n in plan.needs] == [n.max_len for n in plan.needs]
    with pytest.raises(MemoryPlanError, match="with the shortest contexts a default gets \\(4,096 tokens, or the "
                                              "model's if shorter\\) they need [0-9.]+ MiB .*Raise --memory-budget "
                                              "to ([0-9]+)MiB") as err:
        plan_models(refs, {}, 500 * MiB)
    fits = int(str(err.value).split("--memory-budget to ")[1].split("MiB")[0])
    least = plan_models(refs, {}, fits * MiB)
    assert {n.context.used for n in least.needs} <= set(range(4096, 4096 + 16 * 8))
