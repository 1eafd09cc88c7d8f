"""`scratchllm serve qwen2.5-coder-1.5b qwen2.5-coder-0.5b default gemma3-270m` with every option
at its default, on the project's 24 GB machine: the memory plan picks each model's context, the
server starts, says each choice, and every model answers through the official `openai` client.
(It used to refuse the 1.5B at load: "memory plan leaves 626 KV blocks, fewer than the 2048 one
32768-token sequence needs".)

It runs as a user would: with the user's cache folder (the joined chunk packages and the panel
caches of ~/.cache/scratchllm), not the test session's empty one,
where every model would be joined and packed again (minutes): a first run packs, later runs map
what it packed."""

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest

from scratchllm.formats import refs

ROOT = Path(__file__).resolve().parents[2]
MODELS = ["qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", "default", "gemma3-270m"]


@pytest.mark.slow
def test_four_models_start_with_the_defaults_and_each_answers(tmp_path):
    states = {p.name: p.state for p in refs.package_models()}
    missing = [m for m in MODELS if not states.get(m, "").startswith("installed")]
    if missing:
        pytest.skip(f"package models not installed: {missing}")
    env = {k: v for k, v in os.environ.items() if k != "SCRATCHLLM_CACHE_DIR"}
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "scratchllm.cli.main", "serve", *MODELS, "--port", "0",
                                 "--trace", "none"], stderr=out, cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT)})
    try:
        deadline = time.monotonic() + 300
        while not (found := re.search(r" on (http://\S+)", log.read_text())):
            assert proc.poll() is None and time.monotonic() < deadline, f"the server did not start: {log.read_text()}"
            time.sleep(0.5)
        client = openai.OpenAI(base_url=found.group(1) + "/v1", api_key="none", max_retries=0, timeout=120)
        for model in MODELS:
            reply = client.completions.create(model=model, prompt="def add(a, b):", max_tokens=4, temperature=0)
            assert reply.model == model and reply.usage.completion_tokens == 4 and reply.choices[0].text
        text = log.read_text()
        for model in MODELS:  # each context was said at start, each load with its time and memory
            assert re.search(rf"'{re.escape(model)}': context [0-9,]+ tokens", text), text
            assert re.search(rf"loaded '{re.escape(model)}' in [0-9.]+ s: resident memory \+[0-9]+ MiB", text), text
    finally:
        proc.kill()
        proc.wait()
