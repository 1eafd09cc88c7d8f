"""The memory plan, made before serving: weights + KV pool + activations of the largest step.

Over budget is a refusal at start that names the numbers (MemoryPlanError), never an OOM in the
middle of traffic. The pool is allocated once, at its planned size, and never grows.

Activations of the largest step (max_num_batched_tokens = T tokens, float32): the residual
stream and its norm [T, C] x 3, the fused qkv [T, (H + 2 KVH) D], the attention output [T, H D],
the fused gate|up [T, 2I] and its product [T, I], plus the logits of the sampled rows
[max_num_seqs, V] and the kernel's per-thread score buffers [H, max_model_len].
"""

import os
from dataclasses import dataclass

import numpy as np

from scratchllm.engine.config import EngineConfig
from scratchllm.errors import MemoryPlanError
from scratchllm.models.config import ModelConfig
from scratchllm.models.packed import PackedWeight
from scratchllm.models.protocol import Model

MiB = 1 << 20
DEFAULT_KV_BYTES = 1 << 30  # pool size when neither --kv-blocks nor a budget says otherwise


@dataclass(frozen=True)
class MemoryPlan:
    weights_bytes: int
    kv_block_bytes: int
    num_kv_blocks: int
    activation_bytes: int
    budget_bytes: int

    @property
    def kv_bytes(self) -> int:
        return self.kv_block_bytes * self.num_kv_blocks

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.kv_bytes + self.activation_bytes

    def describe(self) -> str:
        return (f"weights {self.weights_bytes / MiB:.1f} MiB + KV pool {self.num_kv_blocks} blocks x "
                f"{self.kv_block_bytes / 1024:.1f} KiB = {self.kv_bytes / MiB:.1f} MiB + activations "
                f"{self.activation_bytes / MiB:.1f} MiB = {self.total_bytes / MiB:.1f} MiB "
                f"(budget {self.budget_bytes / MiB:.1f} MiB)")


def weights_bytes(model: Model) -> int:
    """Bytes of the arrays the forward reads, each buffer counted once (views share memory)."""
    seen: set[int] = set()
    total = 0

    def walk(x: object) -> None:
        nonlocal total
        if isinstance(x, np.ndarray):
            base = x if x.base is None else x.base
            if id(base) not in seen and isinstance(base, np.ndarray):
                seen.add(id(base))
                total += base.nbytes
        elif isinstance(x, PackedWeight):  # a packed matrix: its panels (and a quantized one's scales)
            walk(x.panels)
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)

    walk(getattr(model, "params", None) or dict(getattr(model, "weights", {})))
    return total


def available_bytes() -> int:
    """MemAvailable from /proc/meminfo (Linux); elsewhere physical memory."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def activation_bytes(mc: ModelConfig, cfg: EngineConfig, max_model_len: int) -> int:
    T, C, D = cfg.max_num_batched_tokens, mc.hidden_size, mc.head_dim
    per_token = 3 * C + (mc.num_heads + 2 * mc.num_kv_heads) * D + mc.num_heads * D + 3 * mc.intermediate_size
    threads = cfg.num_threads or os.cpu_count() or 1
    return 4 * (T * per_token + cfg.max_num_seqs * mc.vocab_size + threads * mc.num_heads * (max_model_len + 2 * D))


def plan_memory(model: Model, cfg: EngineConfig, max_model_len: int, weights_already_loaded: bool = True) -> MemoryPlan:
    """Size the KV pool and check the whole against the budget.

    Budget: cfg.memory_budget_bytes, else the memory available now plus the weights (they are
    already loaded, so MemAvailable no longer counts them). Pool: cfg.num_kv_blocks, else
    cfg.kv_cache_memory_bytes, else what max_num_seqs sequences of max_model_len tokens need, at
    most 1 GiB and at most what the budget leaves."""
    mc = model.config
    w = weights_bytes(model)
    block = 2 * mc.num_layers * cfg.block_size * mc.num_kv_heads * mc.head_dim * 4
    act = activation_bytes(mc, cfg, max_model_len)
    budget = cfg.memory_budget_bytes or (available_bytes() + (w if weights_already_loaded else 0))
    if cfg.num_kv_blocks is not None:
        blocks = cfg.num_kv_blocks
    elif cfg.kv_cache_memory_bytes is not None:
        blocks = cfg.kv_cache_memory_bytes // block
    else:  # every sequence at full length: more could never be used at once
        wanted = cfg.max_num_seqs * -(-max_model_len // cfg.block_size) * block
        blocks = min(DEFAULT_KV_BYTES, wanted, budget - w - act) // block
    plan = MemoryPlan(w, block, int(max(blocks, 0)), act, int(budget))
    # one sequence of max_model_len must fit, or a long request could never run
    min_blocks = -(-max_model_len // cfg.block_size)
    if plan.total_bytes > budget or plan.num_kv_blocks < 1:
        raise MemoryPlanError(f"memory plan over budget: {plan.describe()}; lower --kv-blocks, "
                              "--max-num-batched-tokens or raise the memory budget")
    if plan.num_kv_blocks < min_blocks and cfg.num_kv_blocks is None and cfg.kv_cache_memory_bytes is None:
        raise MemoryPlanError(f"memory plan leaves {plan.num_kv_blocks} KV blocks, fewer than the {min_blocks} "
                              f"one {max_model_len}-token sequence needs: {plan.describe()}")
    return plan
