"""Where a decode step's time goes: weight matmuls, attention, the other array operations, Python.

A few greedy decode steps run with timers around the leaf operations of a Llama step, timed
where the model calls them: every weight matrix product of a layer (`linear_into` of
scratchllm/models/llama.py: the packed or quantized GEMM, bias included) and the LM head's
(`x @ lm_head`, PackedWeight.__rmatmul__), the attention call (the KV cache object the model
calls per layer), and the remaining array kernels (RMSNorm and the residual add fused into it,
rotary embedding, the SwiGLU gate, the embedding lookup). What the timers do not cover is the
Python between them: the layer loop, argument passing, the interpreter's calls. A model whose
blocks run in one C call (`params.blocks`, a kernel object with matmul_ns, attention_ns and
other_ns counters of its last run) calls none of the layer leaves: a forward in which no layer
matmul was timed takes that kernel's own split instead. The timers
themselves cost about a microsecond each, ~250 per step: that lands in "Python", which is
therefore an upper bound. Wall-clock time: on a machine shared with other jobs every part grows alike.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

if TYPE_CHECKING:
    from scratchllm.engine.paged_attention import PagedSequence
    from scratchllm.models.config import ModelConfig
    from scratchllm.models.protocol import Model

# each leaf by the attribute the model looks it up through at every call, so that replacing the
# attribute times every call: the layers' matmuls, the LM head's, the other array kernels
LAYER_MATMUL = ("scratchllm.models.llama", "linear_into")
HEAD_MATMUL = ("scratchllm.models.packed", "PackedWeight", "__rmatmul__")  # `x @ w`: looked up on the class
REST = {"scratchllm.models.llama": ("embed",),
        "scratchllm.kernels.pointwise": ("rms_norm", "add_rms_norm", "rope_", "silu_mul")}


class DecodeModel(Protocol):
    """What step_breakdown needs of a model: scratchllm.models.llama.LlamaModel, or one whose
    blocks run in one C call (its `params.blocks`, read with getattr, has the counters)."""

    config: ModelConfig

    def forward(self, input_ids: np.ndarray, positions: np.ndarray, attention: Any,
                logits_rows: list[int] | None = None) -> np.ndarray: ...


@contextmanager
def _timed(owner: object, name: str, totals: dict[str, float], key: str) -> Iterator[None]:
    original: Callable[..., Any] = getattr(owner, name)

    def timed(*args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            totals[key] += time.perf_counter() - t

    setattr(owner, name, timed)
    try:
        yield
    finally:
        setattr(owner, name, original)


class _TimedAttention:
    """The cache, with its per-layer call timed; everything else passes through."""

    def __init__(self, cache: PagedSequence, totals: dict[str, float]) -> None:
        self._cache, self._totals = cache, totals

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return self._cache(*args, **kwargs)
        finally:
            self._totals["attention"] += time.perf_counter() - t

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cache, name)


def step_breakdown(model: DecodeModel, steps: int = 32, prompt_len: int = 16) -> dict[str, float]:
    """ms per decode step: total, matmuls (layer_matmuls + lm_head), attention, rest (array
    kernels), python (the remainder)."""
    import importlib

    from scratchllm.engine.paged_attention import PagedSequence

    fused = getattr(getattr(model, "params", None), "blocks", None)  # every block in one C call, if the model has it
    cache = PagedSequence(model.config, prompt_len + steps + 1)
    ids = np.arange(prompt_len) % model.config.vocab_size
    logits = model.forward(ids, np.arange(prompt_len), cache, logits_rows=[-1])
    totals = {"layer_matmuls": 0.0, "lm_head": 0.0, "attention": 0.0, "rest": 0.0}
    timed_cache = _TimedAttention(cache, totals)
    head_owner = getattr(importlib.import_module(HEAD_MATMUL[0]), HEAD_MATMUL[1])
    patches = [_timed(importlib.import_module(LAYER_MATMUL[0]), LAYER_MATMUL[1], totals, "layer_matmuls"),
               _timed(head_owner, HEAD_MATMUL[2], totals, "lm_head")]
    patches += [_timed(importlib.import_module(mod), name, totals, "rest") for mod, names in REST.items()
                for name in names]
    for p in patches:
        p.__enter__()
    try:
        t = time.perf_counter()
        for _ in range(steps):
            token = int(np.argmax(logits[-1]))
            timed_before = totals["layer_matmuls"]
            logits = model.forward(np.array([token]), np.array([cache.length]), timed_cache)
            if fused is not None and totals["layer_matmuls"] == timed_before:  # the blocks ran in the kernel
                totals["layer_matmuls"] += fused.matmul_ns * 1e-9
                totals["attention"] += fused.attention_ns * 1e-9
                totals["rest"] += fused.other_ns * 1e-9
        total = time.perf_counter() - t
    finally:
        for p in reversed(patches):
            p.__exit__(None, None, None)
    ms = {k: 1e3 * v / steps for k, v in totals.items()}
    ms["matmuls"] = ms["layer_matmuls"] + ms["lm_head"]
    ms["total"] = 1e3 * total / steps
    ms["python"] = ms["total"] - ms["matmuls"] - ms["attention"] - ms["rest"]
    return ms


def batched_breakdown(model: Model, sequences: int = 16, steps: int = 16, prompt_len: int = 32
                      ) -> dict[str, float] | None:
    """ms per engine step of `sequences` sequences decoding at once (one token each; LLMEngine,
    greedy): total, matmuls (the blocks' products at M = sequences, and the LM head's), attention
    (over the sequences' block tables), rest (the blocks' other kernels), sampling, python (the
    remainder: scheduling, the output path). Only for a model whose blocks run in one C call
    (their counters split the step); None otherwise."""
    import importlib

    from scratchllm.engine import engine as engine_module
    from scratchllm.engine.config import EngineConfig
    from scratchllm.engine.engine import LLMEngine
    from scratchllm.sampling import SamplingParams

    fused = getattr(getattr(model, "params", None), "blocks", None)
    if fused is None:
        return None
    engine = LLMEngine(model, EngineConfig(max_num_seqs=sequences, max_model_len=prompt_len + steps + 8,
                                           max_num_batched_tokens=max(512, sequences * prompt_len)))
    rng = np.random.default_rng(0)
    sampling = SamplingParams(temperature=0, max_tokens=steps + 2, ignore_eos=True)
    for i in range(sequences):
        engine.add_request(f"s{i}", rng.integers(0, model.config.vocab_size, prompt_len).tolist(), sampling)
    while any(r.num_output_tokens == 0 for r in engine.requests.values()):  # the prefills, and first tokens
        engine.step()
    totals = {"lm_head": 0.0, "sampling": 0.0}
    head_owner = getattr(importlib.import_module(HEAD_MATMUL[0]), HEAD_MATMUL[1])
    patches = [_timed(head_owner, HEAD_MATMUL[2], totals, "lm_head"),
               _timed(engine_module, "sample", totals, "sampling")]  # the sampling path, as the step calls it
    blocks = {"matmul": 0.0, "attention": 0.0, "rest": 0.0}
    for p in patches:
        p.__enter__()
    try:
        total = 0.0
        for _ in range(steps):
            t = time.perf_counter()
            engine.step()
            total += time.perf_counter() - t
            blocks["matmul"] += fused.matmul_ns * 1e-9
            blocks["attention"] += fused.attention_ns * 1e-9
            blocks["rest"] += fused.other_ns * 1e-9
    finally:
        for p in reversed(patches):
            p.__exit__(None, None, None)
    ms = {"sequences": float(sequences), "total": 1e3 * total / steps,
          "layer_matmuls": 1e3 * blocks["matmul"] / steps, "lm_head": 1e3 * totals["lm_head"] / steps,
          "attention": 1e3 * blocks["attention"] / steps, "rest": 1e3 * blocks["rest"] / steps,
          "sampling": 1e3 * totals["sampling"] / steps}
    ms["matmuls"] = ms["layer_matmuls"] + ms["lm_head"]
    ms["python"] = ms["total"] - ms["matmuls"] - ms["attention"] - ms["rest"] - ms["sampling"]
    return ms


def render_batched(ms: dict[str, float]) -> str:
    return (f"an engine step of {ms['sequences']:.0f} sequences decoding takes {ms['total']:.2f} ms: matmuls "
            f"{ms['matmuls']:.2f} (the LM head's {ms['lm_head']:.2f}), attention {ms['attention']:.2f}, the rest "
            f"(norms, RoPE, SwiGLU) {ms['rest']:.2f}, sampling {ms['sampling']:.2f}, Python {ms['python']:.2f}")


def render_breakdown(ms: dict[str, float]) -> str:
    return (f"a decode step takes {ms['total']:.2f} ms: matmuls {ms['matmuls']:.2f} (the LM head's "
            f"{ms['lm_head']:.2f}), attention {ms['attention']:.2f}, "
            f"the rest (norms, RoPE, SwiGLU, embedding) {ms['rest']:.2f}, Python {ms['python']:.2f}")
