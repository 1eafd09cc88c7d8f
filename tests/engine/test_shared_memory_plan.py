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
