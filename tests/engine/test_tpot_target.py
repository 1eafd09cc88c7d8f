"""A TPOT target: the step-time model fits what steps cost, and the engine holds the target by
capping each step's tokens, so admission stops adding sequences past it. Time here is a fake
clock that the model's forward advances by fixed + per_token x tokens, as a CPU step costs."""

import pytest

from scratchllm.engine import EngineConfig, LLMEngine
from scratchllm.engine.step_time import StepTimeModel
from scratchllm.sampling import SamplingParams

from .tiny import tiny_llama

FIXED, PER_TOKEN = 0.010, 0.0005  # a step of n tokens: 10 ms + 0.5 ms x n


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


class TimedModel:
    """The tiny model, whose forward takes FIXED + PER_TOKEN x tokens of the fake clock."""

    def __init__(self, model, clock):
        self.model, self.clock, self.steps = model, clock, []

    def __getattr__(self, name):
        return getattr(self.model, name)

    def forward(self, ids, positions, attention, logits_rows=None):
        self.clock.t += FIXED + PER_TOKEN * len(ids)
        self.steps.append(len(ids))
        return self.model.forward(ids, positions, attention, logits_rows=logits_rows)


def test_the_model_fits_fixed_and_per_token_costs():
    model = StepTimeModel()
    assert model.max_tokens(0.02) is None  # nothing seen: no cap
    for n in [1, 40, 3, 200, 17, 64, 5, 128, 9, 33]:
        model.observe(n, FIXED + PER_TOKEN * n)
    fixed, per_token = model.fit()
    assert fixed == pytest.approx(FIXED) and per_token == pytest.approx(PER_TOKEN)
    assert model.max_tokens(0.02) == 20  # (20 ms - 10 ms) / 0.5 ms
    same = StepTimeModel()
    for _ in range(10):
        same.observe(16, 0.018)  # every step one size: no slope, seconds proportional to tokens
    assert same.fit() == (0.0, pytest.approx(0.018 / 16)) and same.max_tokens(0.018) == 16


def run(target_s):
    clock = Clock()
    model = TimedModel(tiny_llama(hidden=64, heads=4, kv_heads=2, layers=2), clock)
    engine = LLMEngine(model, EngineConfig(target_tpot_s=target_s, num_kv_blocks=512, max_num_seqs=64), clock=clock)
    prompts = [[(5 * i + j) % 90 + 1 for j in range(30)] for i in range(48)]
    outs = engine.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    tpot = [(o.metrics.finished - o.metrics.first_token) / (len(o.token_ids) - 1) for o in outs]
    return outs, tpot, model.steps


def test_a_tpot_target_caps_the_steps_and_holds():
    free_outs, free_tpot, free_steps = run(None)
    outs, tpot, steps = run(0.020)
    assert [o.token_ids for o in outs] == [o.token_ids for o in free_outs]  # the same tokens, other timing
    assert max(free_steps) > 200 and min(free_tpot) > 0.030  # without a target: big steps, slower tokens
    # past the fit's first steps, every step fits 20 ms: at most 20 tokens
    assert max(steps[StepTimeModel.min_steps :]) <= 20
    # requests admitted before the fit had its first steps may run over (the fit was not yet there):
    # once they are done, every request's TPOT holds the target
    warm = sum(FIXED + PER_TOKEN * n for n in steps[: StepTimeModel.min_steps])
    warm_done = max(o.metrics.finished for o in outs if o.metrics.first_scheduled < warm)
    late = [t for o, t in zip(outs, tpot, strict=True) if o.metrics.first_token > warm_done]
    assert len(late) > 10 and max(late) <= 0.020 + 1e-9
    assert sorted(tpot)[len(tpot) // 2] < sorted(free_tpot)[len(free_tpot) // 2] / 1.5
