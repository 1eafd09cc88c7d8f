"""The memory plan, made before serving: weights + KV pool + activations of the largest step.

Over budget is a refusal at start that names the numbers (MemoryPlanError), never an OOM in the
middle of traffic. The pool is allocated once, at its planned size, and never grows.

Activations of the largest step (max_num_batched_tokens = T tokens, float32): the residual
stream and its norm [T, C] x 3, the fused qkv [T, (H + 2 KVH) D], the attention output [T, H D],
the fused gate|up [T, 2I] and its product [T, I], plus the logits of the sampled rows
[max_num_seqs, V] and the kernel's per-thread score buffers [H, max_model_len].

KV with sliding windows (kv_sizing.layer_groups): the full-attention layers' pool holds
context, the windowed layers' pool only the window. Between steps a sequence holds, per windowed
layer, the blocks of its last `window` positions: at most ceil((window - 1) / block_size) + 1
blocks, the window plus the block being filled; during a step its prefill chunk besides. So the
windowed pool is sized max_num_seqs x (that + 1) + the step's token budget in blocks, whatever
the context, and `kv_sizing.sequence_kv_bytes` is the bound one sequence keeps to.

The default context (max_model_len not given) is the model's, or what the pool the plan leaves
holds when that is less (a sequence can never outgrow the pool), but never below
MIN_DEFAULT_CONTEXT: as llama.cpp's --fit shrinks an unset context to fit the memory, down to a
floor. A context that was asked for and does not fit, or a default below the floor, is refused
naming the context that would fit and the options that make room (`context_error`).
`context_choice` says what was chosen and why, for the server to print at start.
"""

import dataclasses
import os
from dataclasses import dataclass

import numpy as np

from scratchllm.engine.config import EngineConfig
from scratchllm.engine.kv_sizing import block_bytes, kv_bytes_per_token, layer_groups, resolve_kv_dtype, window_blocks
from scratchllm.errors import MemoryPlanError
from scratchllm.models.config import ModelConfig
from scratchllm.models.llama_params import QuantizedRows
from scratchllm.models.packed import PackedWeight
from scratchllm.models.protocol import Model

MiB = 1 << 20
DEFAULT_KV_BYTES = 1 << 30  # pool size when neither --num-kv-blocks nor a budget says otherwise
MIN_DEFAULT_CONTEXT = 4096  # the shortest context chosen by default (llama.cpp's --fit-ctx default)


@dataclass(frozen=True)
class MemoryPlan:
    weights_bytes: int
    kv_block_bytes: int  # the first pool's (every layer's without windows)
    num_kv_blocks: int
    activation_bytes: int
    budget_bytes: int
    window: int = 0  # the windowed layers' window (0: no layer has one)
    window_block_bytes: int = 0  # the windowed layers' pool, when the model has both kinds
    num_window_blocks: int = 0
    kv_dtype: str = "float32"  # the KV cache's element type (resolved: never "auto")
    kv_bytes_per_token: float = 0.0  # K and V of one token of context, every layer, in kv_dtype
    # a draft model (speculative decoding): its weights, its own KV pool (every layer, in
    # kv_dtype) and its step's activations; all 0 without one
    draft_weights_bytes: int = 0
    draft_kv_block_bytes: int = 0
    num_draft_blocks: int = 0
    draft_activation_bytes: int = 0

    @property
    def kv_bytes(self) -> int:
        return self.kv_block_bytes * self.num_kv_blocks + self.window_block_bytes * self.num_window_blocks

    @property
    def draft_bytes(self) -> int:
        """The draft model's weights, KV pool and activations."""
        kv = self.draft_kv_block_bytes * self.num_draft_blocks
        return self.draft_weights_bytes + kv + self.draft_activation_bytes

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.kv_bytes + self.activation_bytes + self.draft_bytes

    @property
    def all_windowed(self) -> bool:
        """Every layer has a window: the one pool bounds no sequence's length."""
        return bool(self.window) and not self.num_window_blocks

    def kv_bytes_for(self, context: int, block_size: int) -> int:
        """This plan's KV bytes with the full-attention pool cut to one sequence of `context`
        tokens (the windowed pool as planned; a pool of windows only as it is)."""
        if self.all_windowed:
            return self.kv_bytes
        return -(-context // block_size) * self.kv_block_bytes + self.window_block_bytes * self.num_window_blocks

    def describe(self) -> str:
        pools = f"{self.num_kv_blocks} blocks x {self.kv_block_bytes / 1024:.1f} KiB"
        if self.num_window_blocks:
            pools += (f" + windowed ({self.window} tokens) {self.num_window_blocks} blocks x "
                      f"{self.window_block_bytes / 1024:.1f} KiB")
        draft = ""
        if self.num_draft_blocks:
            draft = (f" + draft model (weights {self.draft_weights_bytes / MiB:.1f} MiB, KV {self.num_draft_blocks} "
                     f"blocks x {self.draft_kv_block_bytes / 1024:.1f} KiB, activations "
                     f"{self.draft_activation_bytes / MiB:.1f} MiB)")
        return (f"weights {self.weights_bytes / MiB:.1f} MiB + KV pool ({self.kv_dtype}, "
                f"{self.kv_bytes_per_token / 1024:.1f} KiB per token) {pools} = {self.kv_bytes / MiB:.1f} MiB"
                f" + activations {self.activation_bytes / MiB:.1f} MiB{draft} = {self.total_bytes / MiB:.1f} MiB "
                f"(of {self.budget_bytes / MiB:.1f} MiB it may use)")


def weights_bytes(model: Model) -> int:
    """Bytes of the memory the forward reads its weights from, each byte counted once (views and
    fused matrices share memory): the panels and norms the load made or mapped, and the file's
    blocks a table is read from (models/llama_params.QuantizedRows). What the loader holds; the
    header's estimate (shared_memory_plan.estimated_weights_bytes) is tested against it."""
    spans: list[tuple[int, int]] = []  # [start, end) addresses of every array

    def walk(x: object) -> None:
        if isinstance(x, np.ndarray):
            start = int(x.__array_interface__["data"][0])
            spans.append((start, start + x.nbytes))
        elif isinstance(x, PackedWeight):  # a packed matrix: its panels (and a quantized one's scales)
            walk(x.panels)
        elif isinstance(x, QuantizedRows):  # a table read row by row from its file's blocks
            walk(x.raw)
        elif dataclasses.is_dataclass(x) and not isinstance(x, type):  # a model's params (models/llama_params.py)
            for f in dataclasses.fields(x):
                walk(getattr(x, f.name))
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)

    walk(getattr(model, "params", None) or dict(getattr(model, "weights", {})))
    total, reached = 0, 0
    for start, end in sorted(spans):  # the union of the spans
        total += max(0, end - max(start, reached))
        reached = max(reached, end)
    return total


def _proc_bytes(path: str, field: str) -> int | None:
    """A `Field:  N kB` line of a /proc file in bytes (Linux), or None where there is none."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def available_bytes() -> int:
    """MemAvailable from /proc/meminfo (Linux); elsewhere physical memory."""
    found = _proc_bytes("/proc/meminfo", "MemAvailable")
    return found if found is not None else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def resident_bytes() -> int:
    """This process's resident memory now (VmRSS, Linux); 0 where /proc does not say."""
    return _proc_bytes("/proc/self/status", "VmRSS") or 0


def activation_bytes(mc: ModelConfig, cfg: EngineConfig, max_model_len: int) -> int:
    T, C, D = cfg.max_num_batched_tokens, mc.hidden_size, mc.head_dim
    per_token = 3 * C + (mc.num_heads + 2 * mc.num_kv_heads) * D + mc.num_heads * D + 3 * mc.intermediate_size
    threads = cfg.num_threads or os.cpu_count() or 1
    return 4 * (T * per_token + cfg.max_num_seqs * mc.vocab_size + threads * mc.num_heads * (max_model_len + 2 * D))


def plan_memory(model: Model, cfg: EngineConfig, max_model_len: int, weights_already_loaded: bool = True,
                draft: Model | None = None) -> MemoryPlan:
    """Size the KV pool and check the whole against the budget.

    Budget: cfg.memory_budget_bytes, else the memory available now plus the weights (they are
    already loaded, so MemAvailable no longer counts them). Pool: cfg.num_kv_blocks, else
    cfg.kv_cache_memory_bytes, else what max_num_seqs sequences of max_model_len tokens need, at
    most 1 GiB and at most what the budget leaves.

    `draft`: a draft model (speculative decoding), whose weights, activations and KV pool are in
    the plan: its pool holds as many blocks as the target's (every sequence's context, in the
    draft's own layers) and, per sequence, the most drafted tokens' blocks besides; where the
    budget sizes the target's pool, each target block is planned with its draft block."""
    mc = model.config
    w = weights_bytes(model)
    dw = weights_bytes(draft) if draft is not None else 0
    dblock = block_bytes(draft.config, cfg.block_size, None, resolve_kv_dtype(cfg.kv_cache_dtype)) if draft else 0
    dact = activation_bytes(draft.config, cfg, max_model_len) if draft is not None else 0
    spec = cfg.speculative
    k = spec.num_speculative_tokens or 0 if spec is not None else 0
    draft_extra = cfg.max_num_seqs * (-(-k // cfg.block_size) + 1) if draft is not None else 0
    groups = layer_groups(mc)
    bs = cfg.block_size
    dtype = resolve_kv_dtype(cfg.kv_cache_dtype)
    block = block_bytes(mc, bs, len(groups[0].layers), dtype)
    window = groups[-1].window
    # the windowed pool: every sequence's window (+ a block) and the step's prefill chunks
    windowed_need = cfg.max_num_seqs * (window_blocks(window, bs) + 1) + -(-cfg.max_num_batched_tokens // bs)
    wblock = block_bytes(mc, bs, len(groups[1].layers), dtype) if len(groups) == 2 else 0
    full_need = -(-max_model_len // bs)  # blocks of one sequence at full length
    wblocks = 0
    act = activation_bytes(mc, cfg, max_model_len)
    budget = cfg.memory_budget_bytes or (available_bytes() + (w + dw if weights_already_loaded else 0))
    if cfg.num_kv_blocks is not None:  # the windowed pool never needs more than the full one
        blocks = cfg.num_kv_blocks
        wblocks = min(blocks, windowed_need)
    elif cfg.kv_cache_memory_bytes is not None:
        wblocks = min(windowed_need, cfg.kv_cache_memory_bytes // 2 // wblock) if wblock else 0
        blocks = (cfg.kv_cache_memory_bytes - wblocks * wblock) // block
    else:  # every sequence at full length: more could never be used at once
        wblocks = windowed_need if wblock else 0
        per_seq = windowed_need if window and not wblock else cfg.max_num_seqs * full_need
        left = budget - w - act - wblocks * wblock - dw - dact - draft_extra * dblock
        blocks = min(DEFAULT_KV_BYTES // block, per_seq, left // (block + dblock))
    blocks = int(max(blocks, 0))
    plan = MemoryPlan(w, block, blocks, act, int(budget), window, wblock,
                      int(max(wblocks, 0)) if wblock else 0, dtype, kv_bytes_per_token(mc, dtype, block_size=bs),
                      dw, dblock, blocks + draft_extra if draft is not None else 0, dact)
    # one sequence of max_model_len must fit, or a long request could never run
    min_blocks = window_blocks(window, bs) + 1 if plan.all_windowed else full_need
    if plan.total_bytes > budget or plan.num_kv_blocks < 1 or (wblock and plan.num_window_blocks < 1):
        raise MemoryPlanError(f"memory plan over budget: {plan.describe()}; lower --num-kv-blocks, --kv-cache-memory "
                              "or --max-num-seqs, or raise --memory-budget")
    sized_by_plan = cfg.num_kv_blocks is None and cfg.kv_cache_memory_bytes is None
    fits = plan.num_kv_blocks * bs  # the longest sequence the pool holds
    if plan.num_kv_blocks < min_blocks and sized_by_plan and (
            cfg.max_model_len is not None or fits < min(MIN_DEFAULT_CONTEXT, max_model_len)):
        raise MemoryPlanError(context_error(plan, max_model_len, bs, asked=cfg.max_model_len is not None))
    return plan


def context_error(plan: MemoryPlan, context: int, block_size: int, asked: bool) -> str:
    """Why a context does not fit, and what would: the context the pool holds, and the options
    that make the pool larger."""
    what = f"a {context:,}-token context" + (" (--max-model-len)" if asked else " (the model's)")
    fits = plan.num_kv_blocks * block_size
    if fits < 1:
        return (f"{what} does not fit: the memory plan leaves no room for a KV pool ({plan.describe()}); serve "
                "fewer models, or raise --memory-budget")
    floor = "" if asked or fits >= MIN_DEFAULT_CONTEXT else \
        f", below the {MIN_DEFAULT_CONTEXT:,} tokens a default context gets at the least"
    return (f"{what} needs {-(-context // block_size):,} KV blocks, but the memory plan leaves room for "
            f"{plan.num_kv_blocks:,} ({fits:,} tokens{floor}): --max-model-len {fits} fits; or make room with "
            f"--memory-budget, fewer models or a lower --max-num-seqs ({plan.describe()})")


@dataclass(frozen=True)
class ContextChoice:
    """The context a model is served with, and why: its own, the one asked for, or what the
    memory plan's KV pool holds."""

    model_context: int  # the model's (max_position_embeddings)
    asked: int | None  # max_model_len as given (None: the default)
    used: int
    pool_tokens: int | None = None  # the longest sequence the pool holds (None: a windowed pool holds any)

    @property
    def adjusted(self) -> bool:
        """A context was asked for and another is used (the caller should say so)."""
        return self.asked is not None and self.asked != self.used

    def describe(self) -> str:
        if self.asked is not None and self.asked > self.model_context and self.used == self.model_context:
            return (f"--max-model-len {self.asked:,} asked, {self.used:,} used: the model's context length (its "
                    "positions past it were never trained)")
        if self.asked is not None and self.used < self.asked:
            return (f"--max-model-len {self.asked:,} asked, {self.used:,} used: the KV pool (--num-kv-blocks or "
                    f"--kv-cache-memory) holds {self.used:,} tokens of one sequence")
        if self.asked is not None:
            return f"context {self.used:,} tokens (--max-model-len)"
        if self.used == self.model_context:
            return f"context {self.used:,} tokens (the model's)"
        return (f"context {self.used:,} tokens, of the model's {self.model_context:,}: what the KV pool the memory "
                "plan leaves holds (--max-model-len sets another; --memory-budget, --kv-cache-memory or fewer "
                "models make the pool larger)")


def context_choice(model_context: int, asked: int | None, plan: MemoryPlan, block_size: int) -> ContextChoice:
    """The context an engine over this plan serves (the engine's own rule: the model's, capped by
    max_model_len and by what one sequence can hold in the pool)."""
    ctx = min(model_context, asked or model_context)
    pool = None if plan.all_windowed else plan.num_kv_blocks * block_size
    return ContextChoice(model_context, asked, ctx if pool is None else min(ctx, pool), pool)
