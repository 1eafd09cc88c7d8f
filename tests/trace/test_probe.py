"""The engine's own tracer on a tiny random Llama: the ring holds exactly what the engine
produced, and `bench trace` runs end to end."""

import argparse
import json

import numpy as np

from scratchllm.bench import trace as bench_trace
from scratchllm.cli.main import main
from scratchllm.engine import EngineConfig, LLMEngine
from scratchllm.sampling import SamplingParams
from scratchllm.trace import Phase, TokenFlag, TraceWriter, request_key
from scratchllm.trace.views.analysis import Trace
from scratchllm.trace.views.diagnosis import diagnose
from tests.engine.tiny import tiny_llama


def prompts(n=6, length=20, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 96, length + 3 * i).tolist() for i in range(n)]


def test_the_ring_holds_every_token_step_and_phase_the_engine_made(tmp_path):
    model = tiny_llama(seed=2)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    plain = LLMEngine(model, EngineConfig(max_num_seqs=4, max_num_batched_tokens=64)).generate(prompts(), params)
    with TraceWriter(tmp_path / "e.ring", ring_bytes=4096 + 64 * 10_000) as w:
        # max_num_seqs 4 for 6 requests, a small token budget: queueing and chunked prefill
        engine = LLMEngine(model, EngineConfig(max_num_seqs=4, max_num_batched_tokens=64), trace=w)
        for i, p in enumerate(prompts()):
            engine.add_request(f"r{i}", p, params)
        outputs = []
        while engine.has_work():
            outputs += [o for o in engine.step() if o.token_id is not None]
    trace = Trace.load(tmp_path / "e.ring")
    t = trace.tokens
    assert len(t) == len(outputs) == 6 * 12 and trace.dropped == trace.lapped == trace.torn == 0
    for i, result in enumerate(plain):  # tracing changed nothing, and recorded everything
        mine = t[t["request"] == request_key(f"r{i}")]
        assert mine["token_id"].tolist() == result.token_ids
        assert mine["position"].tolist() == list(range(12))
        assert mine["flags"][0] & TokenFlag.FIRST and mine["flags"][-1] & TokenFlag.FINISHED
        spans = trace.spans[trace.spans["request"] == request_key(f"r{i}")]
        assert [Phase(p) for p in spans["phase"]] == [Phase.QUEUED, Phase.PREFILL, Phase.DECODE]
        queued, prefill, decode = spans
        # the latencies add up: arrival -> first token -> ... -> last token
        assert int(mine["latency_ns"].sum()) == int(mine["time_ns"][-1]) - int(queued["start_ns"])
        assert queued["end_ns"] == prefill["start_ns"] and prefill["end_ns"] <= decode["start_ns"]
    assert trace.names == {request_key(f"r{i}"): f"r{i}" for i in range(6)}
    s = trace.steps
    assert s["step"].tolist() == list(range(1, engine.num_steps + 1))
    assert (s["end_ns"] > s["start_ns"]).all() and (s["attention_ns"] > 0).all()
    assert (s["matmul_ns"] + s["attention_ns"] <= s["end_ns"] - s["start_ns"]).all()
    assert s["kv_total"][0] == engine.block_manager.num_blocks
    assert s["waiting"].max() >= 2 and s["waiting"][-1] == 0  # 6 requests for 4 seats: some queued
    assert diagnose(trace)  # the views read a real engine's ring


def test_bench_trace_writer_figures_as_json(capsys):
    assert main(["bench", "trace", "--skip-engine", "--steps", "200", "--repeat", "2", "--ring-mib", "1",
                 "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    w = r["figures"]["writer"]
    assert set(w) >= {"token_step_1", "token_step_16", "token_step_64", "step", "span", "name"}
    assert 0 < w["token_step_16"]["best_ns"] <= w["token_step_16"]["median_ns"]
    # batching amortizes the call: a record in a step of 64 is cheaper than one written alone
    assert w["token_step_64"]["best_ns"] < w["token_step_1"]["best_ns"]
    assert r["ratios"]["ns_per_token_record_step_16"] == w["token_step_16"]["median_ns"]
    assert w["records_written"] == 2 * 200 * (1 + 16 + 64 + 3)


def test_bench_trace_engine_off_vs_on(tmp_path):
    args = argparse.Namespace(requests=4, prompt_len=16, output_len=10, engine_repeat=2, threads=1, seed=0,
                              model="tiny", ring_mib=1, steps=10, repeat=1, skip_engine=False, max_num_seqs=2,
                              ring=str(tmp_path / "kept.ring"))
    e = bench_trace.engine_overhead(tiny_llama(seed=4), args)
    assert len(e["off"]) == len(e["on"]) == 2 and len(e["paired_on_over_off"]) == 2
    assert all(r["output_tokens"] == 40 for r in e["off"] + e["on"])
    assert e["on"][0]["records"] == 40 + e["on"][0]["steps"] + 4 * (1 + 3)  # tokens, steps, names + spans
    assert 0 < e["tracing_share_of_run"] < 1 and e["throughput_on_over_off"] > 0
    kept = Trace.load(tmp_path / "kept.ring")  # the last traced run, for the trace commands
    assert len(kept.tokens) == 40 and kept.steps["batch_size"].max() == 2 and kept.steps["waiting"].max() == 2
    text = bench_trace.render({"inputs": vars(args), "figures": {"writer": bench_trace.writer_costs(2**20, 10, 1),
                                                                  "engine": e}})
    assert "on / off" in text and "per token record" in text
