"""The whole loop on two live servers that really differ: the default model, and the same model
from a weight file whose norm weights are perturbed. Live HTTP traffic is captured, replayed
(the secondary is a second pass on the primary), triaged, scored by three simulated annotators
through the annotation server's HTTP API, reported, and fed back into a real scheduler."""

import json
import re
import shutil
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest

from scratchllm.cli.main import main
from scratchllm.engine.block_manager import BlockManager
from scratchllm.engine.config import EngineConfig
from scratchllm.engine.request import Priority, Request
from scratchllm.engine.scheduler import Scheduler
from scratchllm.evaluate.annotate import create_app
from scratchllm.evaluate.capture import CaptureWriter
from scratchllm.evaluate.feedback import engine_priority_hook, load_priority_hook
from scratchllm.evaluate.store import RunStore
from scratchllm.formats.refs import resolve_model
from scratchllm.sampling import SamplingParams

from .test_annotate import _Server

pytestmark = pytest.mark.slow

PROMPTS = ["My favourite colour is", "The capital of France is", "Once upon a time", "List three fruits:",
           "Write a haiku about the sea.", "The best way to learn is", "My name is", "The weather today"]


def perturbed_model(path, eps=0.15):
    gguf = pytest.importorskip("gguf")
    shutil.copy(resolve_model("default"), path)
    reader = gguf.GGUFReader(str(path), "r+")
    rng = np.random.default_rng(0)
    for t in reader.tensors:
        if t.name.endswith("norm.weight"):  # float32 RMSNorm gains: a small, reproducible change
            t.data[...] = t.data * (1 + eps * rng.standard_normal(t.data.shape)).astype(np.float32)
    reader.data.flush()
    del reader
    return path


class Served:
    def __init__(self, *args):
        self.cmd = [sys.executable, "-m", "scratchllm.cli.main", "serve", "--port", "0", "--embedding-model", "none",
                    "--served-model-name", "default", *args]

    def start(self):
        self.proc = subprocess.Popen(self.cmd, stderr=subprocess.PIPE, text=True)
        return self

    def url(self) -> str:
        line = self.proc.stderr.readline()
        found = re.search(r"http://\S+", line)
        assert found, line + self.proc.stderr.read()
        self.base = found.group(0)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.base + "/health", timeout=5).status_code == 200:
                    return self.base
            except httpx.HTTPError:
                time.sleep(0.2)
        raise AssertionError(f"{self.base} never became healthy")

    def stop(self):
        self.proc.terminate()  # drains what is in flight
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stderr.close()


def live_traffic(url, capture_dir):
    """Clients' requests to the primary; the capture writer records each as the server will."""
    writer = CaptureWriter(capture_dir, rate=1.0, key="e2e-key")
    for i, prompt in enumerate(PROMPTS):
        user = "team-a" if i % 2 == 0 else "team-b"
        if i == 6:
            endpoint, body = "/v1/chat/completions", {"model": "default", "max_tokens": 8, "user": user,
                                                      "messages": [{"role": "user", "content": prompt}]}
        else:
            endpoint, body = "/v1/completions", {"model": "default", "prompt": prompt, "max_tokens": 8, "user": user}
        r = httpx.post(url + endpoint, json=body, timeout=300)
        assert r.status_code == 200, r.text
        data = r.json()
        choice = data["choices"][0]
        text = choice.get("text", (choice.get("message") or {}).get("content"))
        assert writer.should_capture(body)
        writer.record(body, "default", "127.0.0.1", None, data["timings"], endpoint=endpoint, response_text=text,
                      finish_reason=choice["finish_reason"])
    writer.close()


def rule(name, diff, user):
    """How each simulated annotator scores: ann +1 for team-a, -1 for team-b; bob 0; cy +1."""
    return {"ann": 1 if user == "team-a" else -1, "bob": 0, "cy": 1}[name]


def test_capture_replay_triage_annotate_report_feedback(tmp_path):
    candidate_file = perturbed_model(tmp_path / "perturbed.gguf")
    primary = Served("--model", "default").start()
    candidate = Served("--model", str(candidate_file)).start()
    try:
        p_url, c_url = primary.url(), candidate.url()
        live_traffic(p_url, tmp_path / "capture")
        run = tmp_path / "run.sqlite"
        assert main(["eval", "replay", str(tmp_path / "capture"), "--primary", p_url, "--candidate", c_url,
                     "-o", str(run), "--no-progress", "--concurrency", "2"]) == 0
    finally:
        primary.stop()
        candidate.stop()

    store = RunStore(run)
    requests = {r["id"]: r for r in store.requests()}
    assert len(requests) == len(PROMPTS)
    diffs = store.diffs()
    for d in diffs:  # identical exactly when the candidate's tokens and text are the primary's
        outs = store.outputs(d["request_id"])
        same = outs["primary"].tokens == outs["candidate"].tokens and outs["primary"].text == outs["candidate"].text
        assert (d["klass"] == "identical") == same
        assert outs["primary"].tokens and outs["primary"].top_logprobs[0]
    triage = store.run()["options"]["triage"]
    assert triage["noisy_requests"] == []  # greedy on one server: the second pass is the same
    eligible = [d for d in diffs if d["klass"] == "semantic" and not d["noisy"]]
    users = {d["request_id"]: requests[d["request_id"]]["body"]["user"] for d in eligible}
    assert set(users.values()) == {"team-a", "team-b"}, [d["klass"] for d in diffs]

    with _Server(create_app(store)) as url:
        for name in ("ann", "bob", "cy"):
            assert httpx.post(url + "/api/signin", json={"name": name}).json() == {"annotator": name}
            while (diff := httpx.get(url + "/api/next", params={"annotator": name}).json()["diff"]) is not None:
                score = rule(name, diff, users[diff["request_id"]])
                r = httpx.post(url + "/api/score", json={"annotator": name, "request_id": diff["request_id"],
                                                         "score": score})
                assert r.status_code == 200, r.text

    assert main(["eval", "report", str(run), "-o", str(tmp_path / "r.html"), "--json", str(tmp_path / "r.json")]) == 0
    report = json.loads((tmp_path / "r.json").read_text())
    a, b = sum(u == "team-a" for u in users.values()), sum(u == "team-b" for u in users.values())
    n = 3 * (a + b)
    plus, zero, minus = a + (a + b), a + b, b  # ann: +1 on a, -1 on b; bob: 0; cy: +1
    s = report["scores"]
    assert (s["improvement"]["count"], s["neutral"]["count"], s["harm"]["count"], s["total"]) == (plus, zero, minus, n)
    p = plus / n
    z = 1.959963984540054
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * (p * (1 - p) / n + z * z / (4 * n * n)) ** 0.5
    assert s["improvement"]["wilson95"] == pytest.approx([centre - half, centre + half])
    # Fleiss by hand: team-a items are {+1, 0, +1} -> P_i = 1/3; team-b items {-1, 0, +1} -> 0
    p_bar = (a / 3) / (a + b)
    p_e = (minus / n) ** 2 + (zero / n) ** 2 + (plus / n) ** 2
    assert report["agreement"]["fleiss_kappa"] == pytest.approx((p_bar - p_e) / (1 - p_e))
    assert report["worst_regressions"] == []  # team-b's mean is 0, team-a's 2/3: none below 0
    assert report["triage"]["classes"]["semantic"]["net"] == len(eligible)
    assert report["latency"]["candidate_minus_primary_ms"]["n"] == len(PROMPTS)

    assert main(["eval", "feedback", str(run), "-o", str(tmp_path / "priorities.json")]) == 0
    doc = json.loads((tmp_path / "priorities.json").read_text())
    assert doc["classes"]["user:team-a"] == {"score": 2 / 3, "num_scores": 3 * a, "adjust_s": 0.0}
    assert doc["classes"]["user:team-b"]["score"] == pytest.approx(1 / 3)
    assert doc["classes"]["user:team-b"]["adjust_s"] == pytest.approx(-2.0 * (0.5 - 1 / 3) / 0.5)

    hook = load_priority_hook(tmp_path / "priorities.json")
    cls = {"b0": "user:team-b", "a0": "user:team-a", "b1": "user:team-b", "a1": "user:team-a"}

    def order(with_hook):
        cfg = EngineConfig(max_low_per_tick=1)
        sched = Scheduler(cfg, BlockManager(64, cfg.block_size))
        if with_hook:
            sched.priority_hook = engine_priority_hook(hook, lambda req: cls[req.request_id])
        for i, rid in enumerate(cls):
            sched.add(Request(rid, [1, 2, 3], SamplingParams(max_tokens=300, temperature=0.0), Priority.LOW,
                              arrival=0.1 * i))
        admitted, now = [], 1.0
        while sched.has_waiting():
            admitted += [r.request_id for r in sched.schedule(now=now).admitted]
            now += cfg.tick_s
        return admitted

    assert order(False) == ["b0", "a0", "b1", "a1"]
    assert order(True) == ["a0", "a1", "b0", "b1"]
