"""The engine's detokenization in the ring: one DETOKENIZE span per step that made text, keyed
STEP_KEY, inside its step, counting the step's tokens; and in the Perfetto export a
"detokenize" slice inside each such step on the engine-steps thread, on no request's track."""

import json

import numpy as np

from scratchllm.engine import EngineConfig, LLMEngine
from scratchllm.engine.tracing import TimedDetokenizer
from scratchllm.sampling import SamplingParams
from scratchllm.trace import Phase, TraceWriter
from scratchllm.trace.format import STEP_KEY
from scratchllm.trace.views.analysis import Trace
from scratchllm.trace.views.perfetto import STEPS_TID, export
from tests.engine.test_async_engine import LetterTokenizer
from tests.engine.tiny import tiny_llama
from tests.trace.test_views import check_nesting


def traced_run(ring, n=5, max_tokens=8):
    with TraceWriter(ring, ring_bytes=4096 + 64 * 10_000) as w:
        # 3 seats for 5 requests and a small token budget: queueing, chunked prefill, steps of mixed sizes
        engine = LLMEngine(tiny_llama(seed=1), EngineConfig(max_num_seqs=3, max_num_batched_tokens=32),
                           tokenizer=LetterTokenizer(), trace=w)
        rng = np.random.default_rng(0)
        for i in range(n):
            engine.add_request(f"d{i}", rng.integers(1, 96, 12 + 5 * i).tolist(),
                               SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
        per_step = {}
        while engine.has_work():
            events = engine.step()
            made = sum(e.token_id is not None for e in events)
            if made:
                per_step[engine.num_steps] = made
    return Trace.load(ring), per_step


def test_one_detokenize_span_per_step_with_tokens(tmp_path):
    trace, per_step = traced_run(tmp_path / "d.ring")
    spans = trace.spans[trace.spans["phase"] == Phase.DETOKENIZE]
    assert (spans["request"] == STEP_KEY).all()
    assert {int(s["index"]): int(s["count"]) for s in spans} == per_step  # every token detokenized, in its step
    assert sum(per_step.values()) == 5 * 8 == len(trace.tokens)
    steps = {int(s["step"]): s for s in trace.steps}
    for s in spans:
        step = steps[int(s["index"])]
        assert step["start_ns"] <= s["start_ns"] <= s["end_ns"] <= step["end_ns"]


def test_perfetto_shows_detokenize_inside_its_step(tmp_path):
    trace, per_step = traced_run(tmp_path / "d.ring")
    counts = export(trace, tmp_path / "d.json")
    events = json.loads((tmp_path / "d.json").read_text())["traceEvents"]
    check_nesting(events)  # each detokenize slice nests in its step (and in that step's "other" part)
    detok = [e for e in events if e["name"] == "detokenize"]
    assert len(detok) == len(per_step) and all(e["ph"] == "X" and e["tid"] == STEPS_TID for e in detok)
    assert {e["args"]["step"]: e["args"]["tokens"] for e in detok} == per_step
    slices = {e["name"]: e for e in events if e.get("cat") == "step"}
    for d in detok:
        step = slices[f"step {d['args']['step']}"]
        assert step["ts"] <= d["ts"] and d["ts"] + d["dur"] <= step["ts"] + step["dur"] + 1e-6
    assert counts["requests"] == 5  # the step's spans make no request track of their own


def test_no_ring_no_timing():
    engine = LLMEngine(tiny_llama(seed=1), EngineConfig(num_kv_blocks=16), tokenizer=LetterTokenizer())
    engine.add_request("plain", [1, 2, 3], SamplingParams(max_tokens=2))
    assert not isinstance(engine._outputs["plain"].detok, TimedDetokenizer)


def test_bench_trace_times_the_detokenization_it_runs(tmp_path):
    import argparse

    from scratchllm.bench import trace as bench_trace

    args = argparse.Namespace(requests=3, prompt_len=8, output_len=6, engine_repeat=1, threads=1, seed=0,
                              model="tiny", ring_mib=1, steps=10, repeat=1, skip_engine=False, max_num_seqs=0,
                              ring=str(tmp_path / "kept.ring"))
    e = bench_trace.engine_overhead(tiny_llama(seed=4), args, LetterTokenizer())
    on = e["on"][0]
    # all three requests in every step: 6 steps, each with a detokenize span, beside the tokens, steps,
    # names and the three request spans of each request
    assert on["steps"] == 6 and on["records"] == 18 + 6 + 3 * (1 + 3) + 6
    kept = Trace.load(tmp_path / "kept.ring")
    assert kept.spans[kept.spans["phase"] == Phase.DETOKENIZE]["count"].tolist() == [3] * 6
    writer = bench_trace.writer_costs(2**20, 200, 1)
    text = bench_trace.render({"inputs": vars(args), "figures": {"writer": writer, "engine": e}})
    assert "(detokenized)" in text and "timing a token's detokenization" in text
    assert writer["detokenize_timing"]["cpu_median_ns"] < 2000  # a fraction of the per-token budget
