"""Heatmap data, diagnosis, PNG and Perfetto JSON from rings written by a simulated engine whose
stalls, slow requests and latency trends are known in advance."""

import json

import numpy as np
import pytest
from matplotlib import image

from scratchllm.trace.views.analysis import Trace, live_figures, retention_s
from scratchllm.trace.views.diagnosis import LatencyGrid, diagnose
from scratchllm.trace.views.heatmap import draw_heatmap
from scratchllm.trace.views.perfetto import export

from .synthetic import Sim


def load(tmp_path, sim: Sim, name="t") -> tuple[Trace, dict]:
    facts = sim.write(tmp_path / f"{name}.ring")
    return Trace.load(tmp_path / f"{name}.ring"), facts


def patterns(findings) -> set[str]:
    return {f.pattern for f in findings}


def test_an_injected_stall_shows_in_the_heatmap_data_and_the_diagnosis(tmp_path):
    lengths = [40 + 2 * i for i in range(20)]
    trace, facts = load(tmp_path, Sim(lengths=lengths, stalls={30: (200.0, 0, 2)}))
    grid = LatencyGrid.from_trace(trace)
    assert grid.latency_ms.shape == (20, max(lengths))
    assert [trace.name(k) for k in grid.requests] == [f"req-{i}" for i in range(20)]  # arrival order
    # every request started at step 0, so step 30 made position 30 of each: a vertical band
    assert (grid.step[:, 30] == 30).all()
    np.testing.assert_allclose(grid.latency_ms[:, 30], 210.0)
    others = np.delete(grid.latency_ms, 30, axis=1)
    assert np.nanmax(others) == pytest.approx(10.0)
    (finding,) = diagnose(trace, grid)
    assert finding.pattern == "stalled_steps" and finding.values["steps"] == [30]
    assert finding.values["stall_ms"] == [pytest.approx(facts["step_ms"][30])]
    assert "step 30: 210 ms, 20 requests' tokens delayed, 2 preemptions" in finding.text


def test_a_stall_without_step_records_is_found_from_the_tokens(tmp_path):
    trace, _ = load(tmp_path, Sim(lengths=[30] * 8, stalls={12: (90.0, 0, 0)}))
    trace.steps = trace.steps[:0]
    (finding,) = diagnose(trace)
    assert finding.values["steps"] == [12] and "cause not recorded" in finding.text


def test_latency_growing_with_context_reads_as_attention_cost(tmp_path):
    trace, _ = load(tmp_path, Sim(lengths=[100 + 5 * i for i in range(12)], per_context_ms=0.1))
    (finding,) = diagnose(trace)
    assert finding.pattern == "late_tokens" and finding.values["ratio"] > 1.25
    assert "KV / attention" in finding.text


def test_starved_requests_read_as_queueing_or_contention(tmp_path):
    trace, _ = load(tmp_path, Sim(lengths=[60] * 16, every=[1] * 13 + [3] * 3))
    (finding,) = diagnose(trace)
    grid = LatencyGrid.from_trace(trace)
    assert finding.pattern == "slow_rows" and sorted(finding.values["rows"]) == [13, 14, 15]
    assert finding.values["typical_ms"] == pytest.approx(10.0)
    np.testing.assert_allclose(grid.latency_ms[13:, 1:], 30.0)


def test_a_uniform_trace_names_no_pattern(tmp_path):
    trace, _ = load(tmp_path, Sim(lengths=[50] * 10, arrive_step=list(range(10))))
    (finding,) = diagnose(trace)
    assert finding.pattern == "uniform" and finding.values["p99_over_p50"] == pytest.approx(1.0)


def test_the_heatmap_png_has_the_asked_size(tmp_path):
    trace, _ = load(tmp_path, Sim(lengths=[40] * 6, stalls={5: (100.0, 0, 1)}))
    grid = LatencyGrid.from_trace(trace)
    out = draw_heatmap(grid, diagnose(trace, grid), tmp_path / "h.png", width=900, height=600)
    pixels = image.imread(out)
    assert pixels.shape[:2] == (600, 900)
    assert pixels[..., :3].std() > 0.05  # something was drawn


def test_live_figures_match_numpy_on_the_same_records(tmp_path):
    trace, facts = load(tmp_path, Sim(lengths=[20 + i for i in range(8)], stalls={9: (50.0, 0, 0)}))
    fig = live_figures(trace, window_s=1e9)
    t = trace.tokens
    first = (t["flags"] & 1) != 0
    assert fig.tokens == facts["tokens"] == len(t)
    assert fig.itl_ms["p99"] == pytest.approx(np.percentile(t["latency_ns"][~first] / 1e6, 99))
    assert fig.ttft_ms["p50"] == pytest.approx(np.median(t["latency_ns"][first] / 1e6))
    duration = sum(facts["step_ms"].values()) / 1e3
    assert fig.tokens_per_s == pytest.approx(len(t) / duration, rel=0.01)
    assert fig.kv_total == 1000 and fig.waiting == 0
    assert fig.retention_s == pytest.approx(trace.capacity / fig.records_per_s)
    assert retention_s(2_097_088, 1000.0) == pytest.approx(2_097_088 / 1100)


def check_nesting(events):
    """Slices on each track (a thread's X slices; an async track's b/e pairs) nest properly."""
    tracks: dict = {}
    for e in events:
        if e["ph"] == "X":
            tracks.setdefault(("X", e["pid"], e["tid"]), []).append((e["ts"], 0, e["name"], e["ts"] + e["dur"]))
        elif e["ph"] in "be":
            tracks.setdefault((e["cat"], e["id"]), []).append((e["ts"], 0 if e["ph"] == "b" else 1, e["name"], None))
    for key, items in tracks.items():
        if key[0] == "X":
            open_ends = []
            for ts, _, _, end in sorted(items, key=lambda x: (x[0], -x[3])):
                while open_ends and open_ends[-1] <= ts + 1e-9:
                    open_ends.pop()
                assert not open_ends or end <= open_ends[-1] + 1e-6, f"{key}: a slice overlaps its parent"
                open_ends.append(end)
        else:
            stack = []
            # in file order, which the viewers honour for equal timestamps
            for ts, ph, name, _ in items:
                if ph == 0:
                    stack.append((name, ts))
                else:
                    assert stack and stack[-1][0] == name, f"{key}: {name} ends out of order"
                    assert ts >= stack.pop()[1]
            assert not stack, f"{key}: unclosed {stack}"


def test_perfetto_export_loads_nests_and_counts(tmp_path):
    lengths = [12, 20, 16, 9]
    trace, facts = load(tmp_path, Sim(lengths=lengths, arrive_step=[0, 0, 3, 5], stalls={4: (40.0, 0, 1)}))
    counts = export(trace, tmp_path / "t.json")
    doc = json.loads((tmp_path / "t.json").read_text())
    events = doc["traceEvents"]
    check_nesting(events)
    steps = [e for e in events if e.get("cat") == "step"]
    assert len(steps) == facts["steps"] == counts["steps"]
    assert len([e for e in events if e.get("cat") == "step.split"]) == 3 * facts["steps"]
    assert {e["name"] for e in events if e["ph"] == "C"} == {"batch", "KV blocks", "queue"}
    assert len([e for e in events if e["ph"] == "C"]) == 3 * facts["steps"]
    tokens = [e for e in events if e["ph"] == "n"]
    assert len(tokens) == sum(lengths)
    request_tracks = {e["id"] for e in events if e.get("cat") == "request"}
    assert len(request_tracks) == 4 == counts["requests"]
    for rid in request_tracks:
        b = [e["name"] for e in events if e.get("id") == rid and e.get("cat") == "request" and e["ph"] == "b"]
        assert b[1:] == ["queued", "prefill", "decode"] and b[0].startswith("req-")
    server = [e for e in events if e.get("cat") == "server" and e["ph"] == "b"]
    assert len(server) == 2 * 4  # serialize + network send of each request's last chunk
    stalled = next(e for e in steps if e["name"] == "step 4")
    assert stalled["dur"] == pytest.approx(50_000) and stalled["args"]["preempted"] == 1
    assert stalled["args"]["matmul_ms"] == pytest.approx(25.0)


def test_a_window_keeps_only_its_records(tmp_path):
    trace, _ = load(tmp_path, Sim(lengths=[100] * 4))
    first, last = trace.time_range
    part = trace.window(first + 0.2, first + 0.5)
    export(part, tmp_path / "w.json")
    events = json.loads((tmp_path / "w.json").read_text())["traceEvents"]
    check_nesting(events)
    ts = [e["ts"] for e in events if e["ph"] == "n"]
    assert len(ts) == 4 * 31 and min(ts) >= (first + 0.2) * 1e6 - 1 and max(ts) <= (first + 0.5) * 1e6 + 1


def test_a_quiet_server_s_lone_prefills_are_not_stalls(tmp_path):
    """Requests one at a time, each prefill slow and alone: nobody's next token waited on it, so
    no vertical band (such a run used to report one per request)."""
    n, length = 10, 20
    arrive = [(length + 1) * i for i in range(n)]
    trace, _ = load(tmp_path, Sim(lengths=[length] * n, arrive_step=arrive,
                                  stalls={s: (60.0, 0, 0) for s in arrive}))
    assert "stalled_steps" not in patterns(diagnose(trace))


def test_a_stall_that_delays_one_request_says_so_in_good_english(tmp_path):
    trace, _ = load(tmp_path, Sim(lengths=[30], stalls={12: (90.0, 0, 0)}))
    (finding,) = diagnose(trace)
    assert "1 request's token delayed" in finding.text and "requests'" not in finding.text


def test_requests_without_a_last_token_are_named_and_marked(tmp_path):
    """A killed server leaves requests with no last token: they are not drawn as finished."""
    trace, _ = load(tmp_path, Sim(lengths=[40] * 6))
    cut_key = trace.tokens["request"][0]
    mine = trace.tokens["request"] == cut_key
    trace.tokens = trace.tokens[~mine | (trace.tokens["position"] < 25)]
    grid = LatencyGrid.from_trace(trace)
    assert grid.cut.tolist() == [True, False, False, False, False, False]
    findings = diagnose(trace, grid)
    (cut,) = [f for f in findings if f.pattern == "cut"]
    assert cut.values["rows"] == [0] and cut.text.startswith("1 request without a last token")
    assert "uniform" in patterns(findings)  # the rest is still read
    draw_heatmap(grid, findings, tmp_path / "cut.png")


def test_the_colour_bar_has_ticks_across_a_narrow_range():
    from scratchllm.trace.views.heatmap import colour_ticks

    ticks = colour_ticks(8.0, 12.5)
    assert len(ticks) >= 4 and ticks == sorted(ticks) and 8.0 <= ticks[0] and ticks[-1] <= 12.5
    assert len(colour_ticks(0.05, 900.0)) >= 5


def test_the_colour_bar_labels_both_ends_and_never_in_exponent_form():
    """Both ends of the bar are ticks with labels (a rounded first tick left the bottom bare),
    and a large or small value reads as a number (2100, not 2.1e+03)."""
    from scratchllm.trace.views.heatmap import colour_ticks, tick_label

    for lo, hi in [(13.7, 2100.0), (0.0123, 45.0), (7.3, 9.1), (1.04, 1500.0)]:
        ticks = colour_ticks(lo, hi)
        assert ticks[0] == lo and ticks[-1] == hi and ticks == sorted(ticks) and len(ticks) >= 3
        steps = np.diff(np.log(ticks))
        assert steps.min() > 0.5 * steps.max() / 2  # no two ticks crowded together
        labels = [tick_label(t) for t in ticks]
        assert not any("e" in label for label in labels), labels
    assert [tick_label(t) for t in (2100.0, 13.7, 0.0123, 770.0, 8.0)] == ["2100", "13.7", "0.0123", "770", "8"]


def two_model_ring(path):
    """One ring, two simulated engines at once: 'small' at 8 ms a step, 'large' at 24 ms (a
    model three times the size), each with its own requests; no stall, no queueing."""
    from scratchllm.trace import TraceWriter

    from .synthetic import ORIGIN

    with TraceWriter(path, ring_bytes=4096 + 64 * 100_000, clock=lambda: ORIGIN) as w:
        Sim(lengths=[40] * 8, base_ms=8.0, model="small").write(None, writer=w)
        Sim(lengths=[40] * 6, base_ms=24.0, model="large").write(None, writer=w)
    return Trace.load(path)


def test_two_models_of_different_speeds_are_diagnosed_apart(tmp_path):
    from scratchllm.trace.views.diagnosis import compare_models

    trace = two_model_ring(tmp_path / "two.ring")
    assert trace.models == {1: "small", 2: "large"} and trace.model_ids() == [1, 2]
    # read together, the larger model's requests look like starved rows
    assert "slow_rows" in patterns(diagnose(trace))
    grids = {}
    for model in trace.model_ids():
        one = trace.of_model(model)
        assert set(one.tokens["model"].tolist()) == set(one.steps["model"].tolist()) == {model}
        assert len(one.spans) and {trace.name(k)[:5] for k in one.tokens["request"].tolist()} == \
            {trace.model_name(model)[:5]}
        grids[trace.model_name(model)] = grid = LatencyGrid.from_trace(one)
        assert patterns(diagnose(one, grid)) == {"uniform"}
    models = compare_models(grids)
    assert models.values["typical_ms"] == {"small": pytest.approx(8.0), "large": pytest.approx(24.0)}
    assert "'small' 8.0 ms (8 requests), 'large' 24.0 ms (6 requests) (3.0x apart)" in models.text
    pixels = image.imread(draw_heatmap(list(grids.items()), [models], tmp_path / "two.png", 900, 700))
    assert pixels.shape[:2] == (700, 900)


def test_the_export_of_two_models_puts_each_engine_s_steps_on_its_own_track(tmp_path):
    trace = two_model_ring(tmp_path / "two.ring")
    export(trace, tmp_path / "t.json")
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    check_nesting(events)
    threads = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert sorted(threads.values()) == ["engine steps: large", "engine steps: small"]
    steps = [e for e in events if e.get("cat") == "step"]
    assert {e["tid"] for e in steps} == set(threads)
    assert {e["name"] for e in events if e["ph"] == "C"} >= {"batch (small)", "batch (large)"}


def test_an_idle_running_writer_reads_as_idle_not_as_its_last_busy_window(tmp_path):
    """A server that made tokens half a minute ago and none since: its live figures are zero
    tokens/s, with when the last token came, not that window's rate."""
    import time

    from scratchllm.trace import TraceWriter

    path = tmp_path / "idle.ring"
    with TraceWriter(path, ring_bytes=4096 + 64 * 1000) as w:
        then = time.monotonic_ns() - 30 * 10**9
        for step in range(20):
            w.tokens(np.arange(4, dtype=np.uint64), [step] * 4, [1] * 4, 10**7, step=step,
                     time_ns=then + step * 10**7)
        trace = Trace.load(path)
        assert trace.writer_state == "running"
        busy = live_figures(trace, 10.0)  # the old view: the window before the newest record
        idle = live_figures(trace, 10.0, trace.now_s())
    assert busy.tokens_per_s > 100
    assert idle.tokens == 0 and idle.tokens_per_s == 0 and idle.idle_s == pytest.approx(30.0, abs=2.0)
