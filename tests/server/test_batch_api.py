"""OpenAI's Files and Batch API (server/batch_api.py, batch_runner.py, batch_store.py) through the
official `openai` client: 200 chat lines come back as 200 outputs in custom_id order, each equal to
the same request sent on its own; a server SIGKILLed mid-batch and started again on the same
--batch-dir finishes the batch with no line lost and none run twice; every batch request reaches
the engine marked low priority, which the priority policy queues as such; `scratchllm run-batch`
on the same file gives the same outputs; bad input files, wrong endpoints, failing lines and
cancels are answered as OpenAI answers them."""

import io
import json
import re
import sqlite3
import subprocess
import sys
import time

import httpx
import openai
import pytest

from scratchllm.engine.config import EngineConfig
from scratchllm.engine.fake import FakeEngine
from scratchllm.engine.policy import PriorityPolicy
from scratchllm.engine.request import Priority, Request
from scratchllm.sampling import SamplingParams
from scratchllm.server.app import ServerConfig, create_app
from scratchllm.server.backend import fake_backend
from scratchllm.server.state import ServedModel

from .conftest import live_server
from .test_ollama_api import scratchllm_serve


def chat_line(i: int, model: str = "fake", url: str = "/v1/chat/completions") -> dict:
    return {"custom_id": f"request-{i:03d}", "method": "POST", "url": url,
            "body": {"model": model, "messages": [{"role": "user", "content": f"Count to {i}"}], "max_tokens": 6,
                     "temperature": 0}}


def jsonl(lines: list[dict]) -> bytes:
    return "".join(json.dumps(x) + "\n" for x in lines).encode()


def wait_done(client: openai.OpenAI, batch_id: str, timeout_s: float = 120):
    deadline = time.monotonic() + timeout_s
    while (batch := client.batches.retrieve(batch_id)).status not in ("completed", "failed", "cancelled", "expired"):
        assert time.monotonic() < deadline, batch
        time.sleep(0.1)
    return batch


class RecordingEngine(FakeEngine):
    """The fake engine, keeping the params of every request submitted."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.submitted: list[SamplingParams] = []

    def submit(self, prompt_token_ids, params, request_id=None):
        self.submitted.append(params)
        return super().submit(prompt_token_ids, params, request_id)


@pytest.fixture(scope="module")
def server():
    engine = RecordingEngine(step_ms=0.2, max_running=8)
    model = ServedModel("fake", engine, engine.tokenizer, 2048)
    _, embedder = fake_backend()
    with live_server(create_app(model, embedder, ServerConfig(batch_concurrency=4))) as url:
        yield url, engine


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0) as c:
        yield c


def test_200_chat_lines_through_the_openai_client_in_custom_id_order(client, server, tmp_path):
    url, engine = server
    lines = [chat_line(i) for i in range(200)]
    engine.submitted.clear()
    uploaded = client.files.create(file=("in.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
    assert uploaded.purpose == "batch" and uploaded.bytes == len(jsonl(lines))
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h", metadata={"job": "count"})
    assert batch.status in ("validating", "in_progress") and batch.metadata == {"job": "count"}
    batch = wait_done(client, batch.id)
    assert batch.status == "completed" and batch.error_file_id is None
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (200, 200, 0)
    assert batch.in_progress_at and batch.finalizing_at and batch.completed_at
    out = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
    assert [o["custom_id"] for o in out] == [f"request-{i:03d}" for i in range(200)]
    assert all(o["error"] is None and o["response"]["status_code"] == 200 for o in out)
    assert len({o["id"] for o in out}) == 200 and all(o["id"].startswith("batch_req_") for o in out)
    for i in (0, 17, 199):  # each output is the reply the request gets on its own
        alone = client.chat.completions.create(**lines[i]["body"])
        assert out[i]["response"]["body"]["choices"][0]["message"]["content"] == alone.choices[0].message.content
    # every batch request reached the engine marked low priority; a request on its own is not
    batch_params = engine.submitted[:200]
    assert len(batch_params) == 200 and all(p.low_priority for p in batch_params)
    assert not engine.submitted[-1].low_priority
    assert client.files.retrieve(batch.output_file_id).purpose == "batch_output"
    assert batch.id in [b.id for b in client.batches.list(limit=5).data]

    # run-batch on the same file: the same outputs (greedy)
    (tmp_path / "in.jsonl").write_bytes(jsonl(lines))
    done = subprocess.run([sys.executable, "-m", "scratchllm.cli.main", "run-batch", "-i", str(tmp_path / "in.jsonl"),
                           "-o", str(tmp_path / "out.jsonl"), "--fake-engine", "--fake-step-ms", "0.2"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "200 requests, 0 failed" in done.stderr
    offline = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [o["custom_id"] for o in offline] == [o["custom_id"] for o in out]
    assert [o["response"]["body"]["choices"][0]["message"] for o in offline] == \
        [o["response"]["body"]["choices"][0]["message"] for o in out]


def test_the_priority_policy_queues_a_low_priority_request_as_low():
    policy = PriorityPolicy(EngineConfig())
    short = Request("a", [1, 2], SamplingParams(max_tokens=5), None)
    marked = Request("b", [1, 2], SamplingParams(max_tokens=5, low_priority=True), None)
    policy.add(short)
    policy.add(marked)
    assert short.priority == Priority.HIGH and marked.priority == Priority.LOW
    assert list(policy.high) == [short] and list(policy.low) == [marked]


def test_failing_lines_go_to_the_error_file_and_bad_files_fail_the_batch(client, server):
    lines = [chat_line(0), chat_line(1, model="no-such-model"), chat_line(2)]
    f = client.files.create(file=("in.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
    batch = wait_done(client, client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                                    completion_window="24h").id)
    assert batch.status == "completed" and (batch.request_counts.completed, batch.request_counts.failed) == (2, 1)
    errors = [json.loads(x) for x in client.files.content(batch.error_file_id).text.splitlines()]
    assert [e["custom_id"] for e in errors] == ["request-001"] and errors[0]["response"]["status_code"] == 404
    assert [json.loads(x)["custom_id"] for x in client.files.content(batch.output_file_id).text.splitlines()] == [
        "request-000", "request-002"]
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(batch.id)  # completed: nothing to cancel

    bad = jsonl([chat_line(0), chat_line(0), chat_line(3, url="/v1/completions")]) + b"{not json\n"
    f = client.files.create(file=("bad.jsonl", io.BytesIO(bad)), purpose="batch")
    failed = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert failed.status == "failed" and failed.failed_at
    assert [(e.code, e.line) for e in failed.errors.data] == [("duplicate_custom_id", 2), ("mismatched_endpoint", 3),
                                                              ("invalid_json_line", 4)]
    with pytest.raises(openai.BadRequestError, match="endpoint must be one of"):
        client.batches.create(input_file_id=f.id, endpoint="/v1/responses", completion_window="24h")
    with pytest.raises(openai.NotFoundError):
        client.batches.create(input_file_id="file-nothing", endpoint="/v1/chat/completions", completion_window="24h")
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_nothing")
    with pytest.raises(openai.BadRequestError, match="purpose"):
        client.files.create(file=("x.jsonl", io.BytesIO(b"{}")), purpose="fine-tune")

    assert f.id in [x.id for x in client.files.list(purpose="batch").data]
    assert client.files.delete(f.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(f.id)


def test_embeddings_and_completions_lines(client):
    embed = [{"custom_id": f"e{i}", "method": "POST", "url": "/v1/embeddings",
              "body": {"model": "fake-embed", "input": f"text {i}"}} for i in range(3)]
    f = client.files.create(file=("e.jsonl", io.BytesIO(jsonl(embed))), purpose="batch")
    batch = wait_done(client, client.batches.create(input_file_id=f.id, endpoint="/v1/embeddings",
                                                    completion_window="24h").id)
    out = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
    alone = client.embeddings.create(model="fake-embed", input="text 1").data[0].embedding
    assert out[1]["response"]["body"]["data"][0]["embedding"] == alone
    plain = [{"custom_id": "c0", "method": "POST", "url": "/v1/completions",
              "body": {"model": "fake", "prompt": "Once", "max_tokens": 4, "temperature": 0}}]
    f = client.files.create(file=("c.jsonl", io.BytesIO(jsonl(plain))), purpose="batch")
    batch = wait_done(client, client.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                                                    completion_window="24h").id)
    (line,) = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
    alone_text = client.completions.create(**plain[0]["body"]).choices[0].text
    assert line["response"]["body"]["choices"][0]["text"] == alone_text


def test_a_cancelled_batch_keeps_what_ran():
    model, embedder = fake_backend(step_ms=20.0, max_running=2)
    with live_server(create_app(model, embedder, ServerConfig(batch_concurrency=1))) as url, \
            openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0) as client:
        f = client.files.create(file=("in.jsonl", io.BytesIO(jsonl([chat_line(i) for i in range(50)]))),
                                purpose="batch")
        batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        while client.batches.retrieve(batch.id).request_counts.completed < 2:
            time.sleep(0.05)
        assert client.batches.cancel(batch.id).status in ("cancelling", "cancelled")
        batch = wait_done(client, batch.id)
        assert batch.status == "cancelled" and batch.cancelled_at
        ran = batch.request_counts.completed
        assert 2 <= ran < 50
        assert len(client.files.content(batch.output_file_id).text.splitlines()) == ran
        assert client.batches.cancel(batch.id).status == "cancelled"  # again: what it is


def _metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics").text
    return sum(float(m.group(1)) for m in re.finditer(rf"^scratchllm:{name}{{[^}}]*}} (\S+)$", text, re.M))


def test_a_sigkilled_server_resumes_the_batch_losing_none_and_running_none_twice(tmp_path):
    folder = tmp_path / "batches"
    options = ("--fake-engine", "--fake-step-ms", "15", "--batch-dir", str(folder), "--batch-concurrency", "4",
               "--embedding-model", "none")
    lines = [chat_line(i) for i in range(200)]
    with scratchllm_serve(*options) as (url, proc):
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        f = client.files.create(file=("in.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
        batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        while client.batches.retrieve(batch.id).request_counts.completed < 40:
            time.sleep(0.05)
        proc.kill()  # SIGKILL: no drain, no cleanup, lines in flight
        proc.wait()
        client.close()
    with sqlite3.connect(folder / "batches.sqlite3") as db:
        before = db.execute("SELECT COUNT(*) FROM result WHERE batch_id = ?", (batch.id,)).fetchone()[0]
    assert 40 <= before < 200
    with scratchllm_serve(*options) as (url, _), openai.OpenAI(base_url=url + "/v1", api_key="x",
                                                               max_retries=0) as client:
        batch = wait_done(client, batch.id)
        assert batch.status == "completed" and batch.request_counts.completed == 200
        out = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
        assert [o["custom_id"] for o in out] == [f"request-{i:03d}" for i in range(200)]  # none lost, none twice
        # the restarted server ran exactly the lines that had no result: none of the recorded ones again
        assert _metric(url, "request_success_total") == 200 - before


def test_batch_lines_give_way_to_interactive_requests_and_still_finish_once():
    model, embedder = fake_backend(step_ms=5.0, max_running=8)
    app = create_app(model, embedder, ServerConfig(batch_concurrency=2))
    with live_server(app) as url, openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0) as client:
        lines = [{**chat_line(i), "body": {**chat_line(i)["body"], "max_tokens": 40}} for i in range(12)]
        f = client.files.create(file=("in.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
        batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        runner = app.state.batch_runner
        while runner.mine == 0:  # a line is running
            time.sleep(0.005)
        for _ in range(3):  # interactive requests arrive: the running lines are withdrawn, none start
            client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "hi"}], max_tokens=30)
        assert runner.yielded >= 1
        batch = wait_done(client, batch.id)
        out = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
        assert [o["custom_id"] for o in out] == [f"request-{i:03d}" for i in range(12)]
        alone = client.chat.completions.create(**lines[5]["body"]).choices[0].message.content
        assert out[5]["response"]["body"]["choices"][0]["message"]["content"] == alone


@pytest.mark.slow
def test_run_batch_equals_the_served_batch_on_the_real_model(tmp_path):
    questions = ["What is the capital of France?", "Name a primary colour.", "What is 2 + 2?", "Say hello.",
                 "Name a planet.", "What do bees make?", "Name a fruit.", "What colour is the sky?"]
    lines = [{"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "default", "messages": [{"role": "user", "content": q}], "max_tokens": 12,
                       "temperature": 0}} for i, q in enumerate(questions)]
    (tmp_path / "in.jsonl").write_bytes(jsonl(lines))
    options = ("default", "--max-model-len", "512", "--embedding-model", "none")  # the same engine on both sides
    with scratchllm_serve(*options, "--batch-dir", str(tmp_path / "batches"), timeout_s=120) as (url, _), \
            openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0) as client:
        f = client.files.create(file=("in.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
        batch = wait_done(client, client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                                        completion_window="24h").id, timeout_s=300)
        served = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
        alone = client.chat.completions.create(**lines[3]["body"]).choices[0].message.content
    done = subprocess.run([sys.executable, "-m", "scratchllm.cli.main", "run-batch", "-i", str(tmp_path / "in.jsonl"),
                           "-o", str(tmp_path / "out.jsonl"), *options], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    offline = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    contents = [o["response"]["body"]["choices"][0]["message"]["content"] for o in served]
    assert [o["response"]["body"]["choices"][0]["message"]["content"] for o in offline] == contents
    assert "Paris" in contents[0] and contents[3] == alone
