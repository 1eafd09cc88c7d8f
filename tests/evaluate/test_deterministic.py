"""Deterministic mode: the default model replayed against itself, batched (the primary, taking
many requests at once, and its second pass) against one sequence at a time (the candidate,
--max-num-seqs 1), gives zero differences: greedy output does not depend on the batch."""

import json
import os

import pytest

from scratchllm.cli.main import main
from scratchllm.evaluate.store import RunStore

from .test_end_to_end import Served

pytestmark = pytest.mark.slow

SUBJECTS = ["the sea", "a city at night", "bread", "a quiet library", "mountains", "rain", "a train", "the moon"]


def batch_input(path, n: int) -> None:
    """n Batch API lines of varied prompt lengths, so each step batches prompts of different sizes."""
    lines = []
    for i in range(n):
        subject = SUBJECTS[i % len(SUBJECTS)]
        prompt = f"Request {i}. " + "Please " * (i % 5) + f"write one sentence about {subject}."
        body = {"model": "default", "prompt": prompt, "max_tokens": 3}
        lines.append({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions", "body": body})
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))


def test_batched_and_single_sequence_outputs_are_identical(tmp_path):
    n = int(os.environ.get("SCRATCHLLM_DETERMINISTIC_REQUESTS", "8"))
    batch_input(tmp_path / "batch.jsonl", n)
    primary = Served("--model", "default", "--max-num-seqs", "16").start()
    candidate = Served("--model", "default", "--max-num-seqs", "1").start()
    try:
        p_url, c_url = primary.url(), candidate.url()
        rc = main(["eval", "replay", str(tmp_path / "batch.jsonl"), "--primary", p_url, "--candidate", c_url,
                   "-o", str(tmp_path / "run.sqlite"), "--deterministic", "--concurrency", "16", "--no-progress"])
    finally:
        primary.stop()
        candidate.stop()
    triage = RunStore(tmp_path / "run.sqlite").run()["options"]["triage"]
    assert rc == 0 and not triage["server_bug"]
    assert triage["classes"]["identical"] == {"candidate": n, "noise": n, "net": 0, "significant": False}
