"""Speculative decoding in the ring: accepted drafts are TOKEN records flagged DRAFTED, a step
that verified drafts is flagged VERIFY and followed by a VERIFY record (drafted, accepted), and
the views say so: `trace watch` the acceptance rate, the diagnosis the rate per model, the
heatmap a dot per accepted draft, the Perfetto export the counts on the step's slice."""

import json

import numpy as np
import pytest

from scratchllm.cli.main import main
from scratchllm.engine import EngineConfig, LLMEngine
from scratchllm.sampling import SamplingParams
from scratchllm.trace import StepFlag, TokenFlag, TraceWriter
from scratchllm.trace.views.analysis import Trace
from scratchllm.trace.views.diagnosis import diagnose
from scratchllm.trace.views.perfetto import trace_events
from tests.engine.test_speculative import NGRAM, prompts
from tests.engine.tiny import tiny_llama
from tests.trace.synthetic import MS, ORIGIN, Sim


def traced(ring, spec):
    with TraceWriter(ring, ring_bytes=4096 + 64 * 20_000) as w:
        eng = LLMEngine(tiny_llama(seed=1), EngineConfig(speculative_config=spec, num_kv_blocks=128, block_size=4),
                        trace=w)
        for i, p in enumerate(prompts()):
            eng.add_request(f"r{i}", p, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
        while eng.has_work():
            eng.step()
    return Trace.load(ring), eng.stats()


def test_ngram_speculation_marks_drafted_tokens_and_verify_steps(tmp_path):
    trace, stats = traced(tmp_path / "s.ring", NGRAM)
    t, s, v = trace.tokens, trace.steps, trace.verifies
    drafted = (t["flags"] & TokenFlag.DRAFTED) != 0
    verify_steps = s["step"][(s["flags"] & StepFlag.VERIFY) != 0]
    assert len(verify_steps) > 0 and drafted.any()
    assert sorted(v["step"].tolist()) == sorted(verify_steps.tolist())  # one VERIFY record per VERIFY step
    assert (v["accepted"] <= v["drafted"]).all()
    assert int(drafted.sum()) == int(v["accepted"].sum()) == stats.spec_decode_num_accepted_tokens > 0
    assert int(v["drafted"].sum()) == stats.spec_decode_num_draft_tokens
    assert set(t["step"][drafted].tolist()) <= set(verify_steps.tolist())
    # every step's accepted drafts are exactly its DRAFTED tokens
    per_step = dict(zip(v["step"].tolist(), v["accepted"].tolist(), strict=True))
    steps, counts = np.unique(t["step"][drafted], return_counts=True)
    assert {k: c for k, c in zip(steps.tolist(), counts.tolist(), strict=True)} == \
        {k: c for k, c in per_step.items() if c}
    # a draft's latency is its step's, the same as the sibling tokens of its request in that step
    for tok in t[drafted][:20]:
        same = t[(t["request"] == tok["request"]) & (t["step"] == tok["step"])]
        assert len(same) >= 2 and (same["latency_ns"] == tok["latency_ns"]).all() and tok["latency_ns"] > 0
        assert not (tok["flags"] & TokenFlag.FIRST)


def test_without_speculation_nothing_is_marked(tmp_path):
    trace, stats = traced(tmp_path / "n.ring", None)
    assert len(trace.tokens) and stats.spec_decode_num_accepted_tokens is None
    assert not (trace.tokens["flags"] & TokenFlag.DRAFTED).any()
    assert not (trace.steps["flags"] & StepFlag.VERIFY).any()
    assert len(trace.verifies) == 0 and trace.speculation() is None
    assert not any(f.pattern == "speculation" for f in diagnose(trace))


def speculative_ring(path, models=("m",)):
    """A simulated ring per model: Sim's steps (10 ms each), then for every other step a VERIFY
    record of 4 drafted tokens, 3 of them accepted (75 %), the last model's 1 of 4 (25 %)."""
    w = TraceWriter(path, ring_bytes=4096 + 64 * 20_000, clock=lambda: ORIGIN)
    for i, name in enumerate(models):
        facts = Sim([12] * 4, model=name).write(path, writer=w)
        mw = w.for_model(name)
        for step in range(1, facts["steps"], 2):
            mw.verify(step, ORIGIN + (step + 1) * 10 * MS, drafted=4, accepted=3 if i + 1 < len(models) else 1,
                      requests=1, draft_ns=MS // 2)
    w.close()
    return path


def test_watch_shows_drafted_accepted_and_the_acceptance_rate_per_model(tmp_path, capsys):
    ring = speculative_ring(tmp_path / "w.ring", ("big", "small"))
    assert main(["trace", "watch", str(ring), "--once", "--window", "1000"]) == 0
    out = capsys.readouterr().out
    big, small = out.split("model 'small'")
    assert "acceptance rate" in big and "75.0%" in big and "24 / 18" in big
    assert "acceptance rate" in small and "25.0%" in small and "24 / 6" in small


def test_watch_of_a_ring_without_speculation_shows_no_acceptance(tmp_path, capsys):
    ring = tmp_path / "plain.ring"
    Sim([12] * 4).write(ring)
    assert main(["trace", "watch", str(ring), "--once", "--window", "1000"]) == 0
    out = capsys.readouterr().out
    assert "tokens/s" in out and "acceptance" not in out
    assert Trace.load(ring).speculation() is None


def test_heatmap_marks_accepted_drafts_and_the_diagnosis_gives_the_rate(tmp_path, capsys, monkeypatch):
    ring = tmp_path / "h.ring"
    w = TraceWriter(ring, ring_bytes=4096 + 64 * 20_000, clock=lambda: ORIGIN)
    Sim([12] * 4).write(ring, writer=w)
    # request "extra": three tokens from one verification step, the first two accepted drafts
    key = w.register("extra")
    w.tokens(np.array([key] * 3, np.uint64), [0, 1, 2], [5, 6, 7], [0, 0, 0], step=99, time_ns=ORIGIN + 5 * MS)
    w.tokens(np.array([key] * 3, np.uint64), [3, 4, 5], [5, 6, 7], [8 * MS] * 3, step=100, time_ns=ORIGIN + 9 * MS,
             flags=[TokenFlag.DRAFTED, TokenFlag.DRAFTED, TokenFlag.FINISHED])
    w.step(100, ORIGIN + MS, ORIGIN + 9 * MS, batch_size=1, step_tokens=3, flags=StepFlag.VERIFY)
    w.verify(100, ORIGIN + 9 * MS, drafted=3, accepted=2, requests=1)
    w.close()
    from matplotlib.figure import Figure

    drawn = []
    save = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda self, *a, **k: (drawn.append(self), save(self, *a, **k))[1])
    assert main(["trace", "heatmap", str(ring), "-o", str(tmp_path / "h.png")]) == 0
    out = capsys.readouterr().out
    assert "speculative decoding: 2 of 3 drafted tokens accepted (67%)" in out
    (fig,) = drawn
    marks = [c for ax in fig.axes for c in ax.collections if "accepted draft" in str(c.get_label())]
    assert len(marks) == 1 and len(marks[0].get_offsets()) == 2
    assert sorted(map(tuple, np.asarray(marks[0].get_offsets()).tolist()))[0][0] == 3  # at positions 3 and 4


def test_the_export_puts_the_counts_on_the_verifying_step(tmp_path):
    trace = Trace.load(speculative_ring(tmp_path / "e.ring"))
    slices = [e for e in trace_events(trace) if e.get("cat") == "step"]
    verified = [e for e in slices if "accepted_tokens" in e["args"]]
    assert verified and all(e["args"]["drafted_tokens"] == 4 and e["args"]["accepted_tokens"] == 1 for e in verified)
    assert {e["name"] for e in verified} == {f"step {int(s)}" for s in trace.verifies["step"]}
    assert any("accepted_tokens" not in e["args"] for e in slices)
    json.dumps(slices)


@pytest.mark.parametrize("window", [False, True])
def test_acceptance_follows_the_window_and_the_model(tmp_path, window):
    trace = Trace.load(speculative_ring(tmp_path / "a.ring", ("big", "small")))
    if window:
        trace = trace.window(0, 0.065)  # steps 0-5 (ending at 10 ... 60 ms): verifications of steps 1, 3, 5
    big = trace.of_model(trace.model_id("big")).speculation()
    small = trace.of_model(trace.model_id("small")).speculation()
    assert big is not None and small is not None
    n = 3 if window else 6
    assert (big.drafted, big.accepted, small.drafted, small.accepted, big.steps) == (4 * n, 3 * n, 4 * n, n, n)
    assert big.rate == 0.75 and small.rate == 0.25
