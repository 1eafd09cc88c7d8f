"""The public surface is locked: changing it is a decision, not an accident (SPEC, Public surface)."""

import subprocess
import sys

import scratchllm


def test_all_is_locked():
    assert sorted(scratchllm.__all__) == sorted(
        ["LLM", "SamplingParams", "Tokenizer", "load_checkpoint", "FormatError", "__version__"]
    )


def test_format_error_is_a_value_error():
    err = scratchllm.FormatError("x.gguf", "bad magic")
    assert isinstance(err, ValueError)
    assert str(err) == "x.gguf: bad magic"


def test_cli_help_runs():
    out = subprocess.run([sys.executable, "-m", "scratchllm.cli.main", "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    assert "scratchllm" in out.stdout
