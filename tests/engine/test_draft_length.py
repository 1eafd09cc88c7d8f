"""The draft-length rule: as many drafts as raise the step's tokens per second."""

import pytest

from scratchllm.engine.speculative.draft_length import Acceptance, StepCost, expected_tokens, plan


def best_single(a, limit, cost):
    """One request: the k with the most tokens per second, by trying every k."""
    def speed(k):
        return expected_tokens(a, k) / (cost.fixed + cost.per_row * (1 + k) + cost.per_draft * k)
    return max(range(limit + 1), key=lambda k: (speed(k), -k))


@pytest.mark.parametrize("a", [0.0, 0.2, 0.5, 0.7, 0.9, 0.97, 1.0])
@pytest.mark.parametrize("cost", [StepCost(0.036, 0.002), StepCost(0.036, 0.002, 0.013), StepCost(0.01, 0.01)])
def test_one_request_gets_the_best_length(a, cost):
    assert plan([a], [8], cost) == [best_single(a, 8, cost)]


def test_one_stream_drafts_long_a_large_batch_little():
    cheap_rows = StepCost(fixed=0.036, per_row=0.0015)  # bound by reading the weights
    assert plan([0.8], [5], cheap_rows) == [5]
    assert plan([0.02], [5], cheap_rows) == [0]  # drafts almost always rejected: not worth a row
    # 16 decodes at once: the rows are most of the step; only the likely drafts are worth it
    batch = plan([0.8] * 16, [5] * 16, StepCost(0.036, 0.004))
    assert sum(batch) < 16 * 5
    assert plan([0.3] * 16, [5] * 16, StepCost(0.036, 0.004)) == [0] * 16


def test_limits_and_minimum():
    cost = StepCost(0.036, 0.001)
    assert plan([0.9, 0.9], [2, 0], cost) == [2, 0]
    got = plan([0.6, 0.9], [6, 6], cost, minimum=3)
    assert all(k == 0 or k >= 3 for k in got)
    assert plan([], [], cost) == []


def test_acceptance_counts_positions_tested():
    acc = Acceptance()
    assert acc.rate(0.5, 4) == 0.5  # the prior alone
    acc.record(drafted=5, accepted=5, decay=1.0)  # five tested, all accepted
    acc.record(drafted=5, accepted=1, decay=1.0)  # two tested: one accepted, one rejected
    assert (acc.accepted, acc.tested) == (6, 7)
    assert acc.rate(0.5, 0) == 6 / 7
    acc.idle(0.5)
    assert (acc.accepted, acc.tested) == (3, 3.5)
    with pytest.raises(AssertionError):
        acc.record(2, 3, 1.0)


def test_measured_steps_decide_over_the_fit():
    """The products' cost jumps where a kernel's tile of rows fills: measured step times choose the
    length the fit would miss (here 2 drafts, before the jump at 4 rows)."""
    measured = {1: 1.0, 2: 1.1, 3: 1.2, 4: 2.0, 5: 2.1, 6: 2.2}
    cost = StepCost(fixed=1.0, per_row=0.2, measured=measured)
    assert plan([0.9], [5], cost) == [2]
    assert plan([0.9], [5], StepCost(fixed=1.0, per_row=0.2)) == [5]  # the fit alone: linear, cheap rows
    assert cost.seconds(3) == 1.2 and cost.seconds(9) == 1.0 + 0.2 * 9 and cost.added(3, 1) == 0.8


def test_a_request_the_rule_keeps_from_drafting_is_probed_with_backoff():
    """A request whose estimate rests on a pessimistic prior never drafts by the rule, so it would
    never be measured: after PROBE_INTERVAL steps without a draft it drafts PROBE_LENGTH tokens;
    each probe doubles the interval, accepted or not (drafts that are accepted yet do not pay must
    not be probed every PROBE_INTERVAL steps); a draft the rule itself chooses resets it."""
    from scratchllm.engine.request import Request
    from scratchllm.engine.speculative import speculator as sp
    from scratchllm.engine.speculative.config import SpeculativeConfig
    from scratchllm.sampling import SamplingParams

    spec = sp.Speculator(SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_min=1,
                                           prompt_lookup_max=2), max_model_len=10_000)
    spec.cost = lambda: StepCost(1.0, 5.0)  # a row costs five steps: the rule never drafts
    req = Request("r", [1, 2, 3] * 50, SamplingParams(max_tokens=1000), None)  # lookups always find a proposal

    def steps_to_probe() -> int:
        for n in range(1, 1000):
            drafts = spec.propose([req])
            if drafts:
                assert len(drafts[req].tokens) == sp.PROBE_LENGTH
                return n
        raise AssertionError("no probe")

    assert steps_to_probe() == sp.PROBE_INTERVAL
    spec.verified(req, sp.PROBE_LENGTH, 0, 1)  # rejected: the next probe waits twice as long
    assert steps_to_probe() == 2 * sp.PROBE_INTERVAL
    spec.verified(req, sp.PROBE_LENGTH, 2, 3)  # accepted, but a row still costs five steps: twice again
    assert steps_to_probe() == 4 * sp.PROBE_INTERVAL
    for _ in range(10):
        spec.verified(req, sp.PROBE_LENGTH, 0, 1)
        steps_to_probe()
    assert steps_to_probe() == sp.PROBE_MAX_INTERVAL  # the backoff's ceiling
    spec.cost = lambda: StepCost(1.0, 0.01)  # rows now cheap: the rule drafts, and the probes start over
    assert spec.propose([req])  # the step right after a probe: a draft only the rule can have chosen
    spec.cost = lambda: StepCost(1.0, 5.0)
    assert steps_to_probe() == sp.PROBE_INTERVAL
    adaptive_off = sp.Speculator(SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_min=1,
                                                   prompt_lookup_max=2, adaptive=False), max_model_len=10_000)
    assert len(adaptive_off.propose([req])[req].tokens) == 4  # no rule, no probes: the fixed length
