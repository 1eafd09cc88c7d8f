"""The atheris harnesses (fuzz/run.py) over every seed corpus plus a fixed number of mutations, in
one process: no parser raises anything but the project's errors, none runs out of memory or time.
The long runs are `make fuzz` (docs/fuzzing.md)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TARGETS = ["gguf", "safetensors", "torch", "unpickle", "tokenizer_json", "chat_template"]
RUNS = int(os.environ.get("SCRATCHLLM_FUZZ_RUNS", "300"))  # the seeds, then mutations of them


def test_every_target_has_a_small_seed_corpus() -> None:
    sys.path.insert(0, str(ROOT / "fuzz"))
    try:
        from targets import TARGETS as defined
    finally:
        sys.path.remove(str(ROOT / "fuzz"))
    assert list(defined) == TARGETS
    for target in TARGETS:
        seeds = list((ROOT / "fuzz" / "corpus" / target).iterdir())
        assert seeds and all(0 < s.stat().st_size <= 8 << 10 for s in seeds), target


def test_every_harness_over_its_corpus_and_mutations(tmp_path: Path) -> None:
    pytest.importorskip("atheris")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for k, target in enumerate(TARGETS):  # the `all` target reads its first byte as the target's index
        for seed in (ROOT / "fuzz" / "corpus" / target).iterdir():
            (corpus / f"{target}-{seed.name}").write_bytes(bytes([k]) + seed.read_bytes())
    seeds = len(list(corpus.iterdir()))
    run = subprocess.run(
        [sys.executable, str(ROOT / "fuzz" / "run.py"), "all", str(corpus), f"-runs={RUNS}", "-seed=1",
         f"-artifact_prefix={tmp_path}/", "-rss_limit_mb=2048", "-timeout=10"],
        capture_output=True, text=True, timeout=300, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    log = run.stdout + run.stderr
    assert run.returncode == 0 and not list(tmp_path.glob("crash-*")), log[-3000:]
    assert f"INFO: seed corpus: files: {seeds} " in log and f"Done {RUNS} runs" in log, log[-2000:]
