"""What `serve` says at start and while it runs: each model's context (and a flag that was
clamped: the value asked, the value used, why), after the address line that scripts read as
"ready"; and each load, unload and reload with its duration and memory."""

import asyncio
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx

from scratchllm.server.app import ServerConfig, create_app
from scratchllm.server.backend import fake_specs, model_specs
from scratchllm.server.registry import ModelRegistry

ROOT = Path(__file__).resolve().parents[2]


def test_a_clamped_context_and_concurrency_are_said_after_the_address(tmp_path):
    """`--max-model-len 1000000000000` used to start silently with 8192; --max-num-seqs past
    --max-in-flight could never run that many at once."""
    proc = subprocess.Popen([sys.executable, "-m", "scratchllm.cli.main", "serve", "default", "--port", "0",
                             "--load", "first-use", "--embedding-model", "none", "--trace", "none",
                             "--max-model-len", "1000000000000", "--max-num-seqs", "100"],
                            stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        first = proc.stderr.readline()
        assert re.fullmatch(r"scratchllm serve: default on http://127\.0\.0\.1:\d+\n", first), first
        said = [proc.stderr.readline() for _ in range(3)]
    finally:
        proc.kill()
        proc.wait()
        proc.stderr.close()
    assert said[0] == ("scratchllm serve: 'default': --max-model-len 1,000,000,000,000 asked, 8,192 used: the "
                       "model's context length (its positions past it were never trained)\n")
    assert said[1] == ("scratchllm serve: --max-num-seqs 100 asked, at most 64 run at once: --max-in-flight 64 is "
                       "what each model holds at once, running and waiting\n")


def test_loads_unloads_and_reloads_are_said_with_their_time_and_memory(serve):
    said: list[str] = []
    registry = ModelRegistry(fake_specs(["alpha"], embedder=False, step_ms=1.0), keep_alive_s=0.3,
                             report=said.append)
    with serve(create_app(registry, config=ServerConfig())) as url:
        body = {"model": "alpha", "prompt": "hi", "max_tokens": 2}
        for _ in range(2):
            assert httpx.post(url + "/v1/completions", json=body, timeout=20).status_code == 200
            deadline = time.monotonic() + 10
            while not any(line.startswith("unloaded") for line in said[len(said) - 1:]):
                assert time.monotonic() < deadline, said
                time.sleep(0.05)
    number = r"[0-9]+\.[0-9]"
    patterns = [rf"loaded 'alpha' in {number} s: resident memory [+-][0-9]+ MiB, now [0-9]+ MiB",
                rf"unloaded 'alpha' after {number} s idle \(keep-alive 0\.3 s\) in {number} s: resident memory "
                r"[+-][0-9]+ MiB, now [0-9]+ MiB",
                rf"reloaded \(load 2\) 'alpha' in {number} s: resident memory",
                rf"unloaded 'alpha' after {number} s idle"]
    assert len(said) == 4 and all(re.match(p, line) for p, line in zip(patterns, said, strict=True)), said


def test_an_unloaded_model_s_memory_is_given_back_at_once():
    """The default model's weights go when it is unloaded, not at some later garbage collection:
    the unload line says how much resident memory it gave back (the unload's own closure used to
    hold the last reference while it collected)."""
    said: list[str] = []
    specs, _ = model_specs(["default"], {"max_num_seqs": 2}, budget_bytes=None)
    registry = ModelRegistry(specs, keep_alive_s=0.0, report=said.append)
    create_app(registry, config=ServerConfig())  # binds the registry; nothing is served
    registry.load_all()
    entry = registry.entry("default")

    async def unload_and_wait() -> None:
        registry._unload(entry)
        assert entry.closing is not None
        await entry.closing
        await asyncio.sleep(0)  # the done callback, which reports

    asyncio.run(unload_and_wait())
    registry.load_all()  # again: the first load's one-time costs (imports, packing) are behind us
    asyncio.run(unload_and_wait())
    assert [line.split()[0] for line in said] == ["loaded", "unloaded", "reloaded", "unloaded"], said
    grew = int(re.search(r"resident memory ([+-][0-9]+) MiB", said[2]).group(1))
    gave = int(re.search(r"resident memory ([+-][0-9]+) MiB", said[3]).group(1))
    assert grew > 50 and gave < -max(50, grew / 2), said
