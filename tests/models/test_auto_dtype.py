"""dtype "auto": int8 products for models of 0.4B parameters or more, int16 below (where the
build has VNNI dot products), the exact path without them; float32 for unquantized files."""

import pytest

from scratchllm.formats import load_checkpoint
from scratchllm.formats.refs import resolve_model
from scratchllm.kernels import packed_gemm
from scratchllm.models import loader


@pytest.mark.parametrize(("ref", "big"), [("default", False), ("gemma3-270m", False), ("qwen2.5-coder-0.5b", True)])
def test_auto_picks_by_the_parameter_count(ref, big):
    path = resolve_model(ref)
    ckpt = load_checkpoint(path)
    n = loader.parameter_count(ckpt)
    assert (n >= loader.INT8_MIN_PARAMETERS) == big, n
    dtype = loader.auto_dtype(ckpt, loader.read_config(path, ckpt))
    expected = ("int8" if big else "int16") if packed_gemm.INT_DOT_INSTRUCTION else "quantized"
    assert dtype == expected
