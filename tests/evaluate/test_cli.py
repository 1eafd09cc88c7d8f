"""`scratchllm eval` over real HTTP on two fake-engine servers (fast): replay, triage in
deterministic mode, report and feedback from the command line; bad input is a one-line error."""

import json

import pytest

from scratchllm.cli.main import main
from scratchllm.evaluate.store import RunStore

from .test_end_to_end import Served


@pytest.fixture(scope="module")
def fake_servers():
    servers = [Served("--fake-engine", "--fake-step-ms", "0.5").start() for _ in range(2)]
    try:
        yield [s.url() for s in servers]
    finally:
        for s in servers:
            s.stop()


def test_replay_triage_report_feedback_on_fake_servers(tmp_path, fake_servers, capsys):
    primary, candidate = fake_servers
    batch = tmp_path / "batch.jsonl"
    lines = [{"custom_id": f"c{i}", "url": "/v1/completions",
              "body": {"model": "default", "prompt": f"prompt number {i}", "max_tokens": 6, "user": "u"}}
             for i in range(5)]
    lines.append({"custom_id": "chat", "url": "/v1/chat/completions",
                  "body": {"model": "default", "max_tokens": 6, "messages": [{"role": "user", "content": "hi"}]}})
    batch.write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"custom_id": "cut", "url"')  # a partial line
    run = tmp_path / "run.sqlite"
    assert main(["eval", "replay", str(batch), "--primary", primary, "--candidate", candidate, "-o", str(run),
                 "--deterministic", "--no-progress", "--api-key", "sk-x"]) == 0
    captured = capsys.readouterr()
    assert "skipped 1 partial last line" in captured.err and "replayed 6 requests" in captured.out
    store = RunStore(run)
    assert [d["klass"] for d in store.diffs()] == ["identical"] * 6
    out = store.outputs(store.requests()[0]["id"])["candidate"]
    # the fake engine's logprobs are its rows': the phrase's next byte all but certain, the rest far below
    top = out.top_logprobs[0]
    assert len(out.tokens) == 6 and top[0] == (out.tokens[0], out.logprobs[0]) and -1e-3 < out.logprobs[0] <= 0
    assert 1 < len(top) <= 5 and all(lp < -10 for _, lp in top[1:])
    assert main(["eval", "triage", str(run), "--deterministic"]) == 0
    assert main(["eval", "report", str(run)]) == 0
    report = json.loads(run.with_suffix(".json").read_text())
    assert report["scores"]["total"] == 0
    assert report["triage"]["classes"]["identical"] == {"candidate": 6, "noise": 6, "net": 0, "significant": False}
    assert run.with_suffix(".html").read_text().startswith("<!doctype html>")
    assert main(["eval", "feedback", str(run), "-o", str(tmp_path / "p.json")]) == 0
    assert json.loads((tmp_path / "p.json").read_text())["classes"] == {}


@pytest.mark.parametrize("argv, problem", [
    (["eval", "report", "missing.sqlite"], "no such run file"),
    (["eval", "annotate", "x.sqlite", "--classes", "bogus"], "--classes takes"),
    (["eval", "replay", "missing-capture", "--primary", "http://a", "--candidate", "http://b", "-o", "r.sqlite"],
     "no such capture"),
])
def test_bad_input_is_a_one_line_error(tmp_path, monkeypatch, capsys, argv, problem):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    assert problem in capsys.readouterr().err
