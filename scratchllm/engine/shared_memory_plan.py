"""The memory plan of several models in one process (`scratchllm serve MODEL MODEL ...`), made
from their headers before any weights are read, so that what does not fit is refused at start.

Each model's need:
  weights      an upper bound of what the loader will hold, from the tensor table: per matrix
               (a 2-D tensor), at a quantized dtype ("quantized", "int8", "int16") the bytes a
               weight of its type takes in its panels (models/packed.panel_bytes_per_weight: 0.625
               for Q4_0 / Q4_1, 0.58 / 0.70 / 0.82 / 0.57 / 0.64 for Q4_K / Q5_K / Q6_K / Q3_K /
               Q2_K, 1.06 for Q8_0, 1.25 for the other 32-wide types), 4 for the rest
               (dequantized); at "bfloat16" 2; at "float32" 4;
               every vector 4 bytes an element; plus 1% and 1 MiB for what the loader adds (rotary
               tables, copies of norms). The matrices' layouts are models/packed.py's.
  KV pool and  a generator's, as engine/memory_plan.py's plan_memory sizes them for the engine
  activations  options, against what the models before it left of the budget
  activations  an embedder's: one batch of EMBED_PLAN_ROWS inputs of its longest length (hidden
               states, the attention scores and the feed-forward's inner layer, float32)
  draft model  a generator's speculative config may name one: its weights (the same bound, at its
               "auto" dtype), KV pool and activations are the generator's too

A package model cut into chunk packages that is not joined yet is planned from its first
chunk's header (formats.load_header): the join waits for its load, on first use with `serve
--load first-use`.

The models are planned in the order given; the budget is `memory_budget_bytes` (`serve
--memory-budget`), else the memory available at start. With the default contexts, a plan that
does not fit that way shares the room the weights and activations leave among the generators'
KV pools, each context shrinking with its pool down to memory_plan.MIN_DEFAULT_CONTEXT, so that
several models fit beside each other. Over budget is a MemoryPlanError that names every model's
figures. Each engine then plans its own pool within its share
(EngineConfig.memory_budget_bytes = the need planned here), so a model loaded on first use, or
loaded again after an unload, finds the memory it was planned.
"""

from __future__ import annotations

import math
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scratchllm.engine.config import EngineConfig
from scratchllm.engine.memory_plan import (
    MIN_DEFAULT_CONTEXT,
    ContextChoice,
    MiB,
    available_bytes,
    context_choice,
    plan_memory,
)
from scratchllm.errors import ConfigError, MemoryPlanError
from scratchllm.formats import load_header
from scratchllm.formats.checkpoint import Checkpoint
from scratchllm.formats.ggml_quants import FILE_TYPES
from scratchllm.formats.sampling_defaults import recommended_sampling
from scratchllm.models.config import ModelConfig
from scratchllm.models.loader import auto_dtype, read_config
from scratchllm.models.packed import panel_bytes_per_weight
from scratchllm.models.protocol import Attention, Ints, Logits

EMBED_PLAN_ROWS = 8  # inputs of one embedding batch the plan holds activations for
ENGINE_ONLY = ("dtype", "batching")  # engine options that are not EngineConfig's


@dataclass(frozen=True)
class ModelNeed:
    """One model's planned bytes, and what its header says about it."""

    ref: str
    task: str  # "generate" (a decoder, with an engine and KV pool) or "embed" (an encoder)
    weights_bytes: int
    kv_bytes: int
    activation_bytes: int
    max_len: int  # context tokens (a generator's, as its pool allows) or an embedder's longest input
    details: dict[str, Any]  # family, format, parameters, quantization, context (Ollama's /api/show)
    context: ContextChoice | None = None  # a generator's: the context chosen, and why
    least_kv_bytes: int = 0  # a generator's KV with one sequence of the shortest default context

    @property
    def least_bytes(self) -> int:
        """Its need with the shortest KV pool a default context allows (an embedder's: all of it)."""
        return self.weights_bytes + self.activation_bytes + (self.least_kv_bytes if self.task == "generate" else 0)

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.kv_bytes + self.activation_bytes

    def describe(self) -> str:
        return (f"'{self.ref}' {self.total_bytes / MiB:.1f} MiB (weights {self.weights_bytes / MiB:.1f} + KV "
                f"{self.kv_bytes / MiB:.1f} + activations {self.activation_bytes / MiB:.1f})")


@dataclass(frozen=True)
class _HeaderModel:
    """A model as its header describes it: what plan_memory reads (its config), no weights."""

    config: ModelConfig

    def forward(self, input_ids: Ints, positions: Ints, attention: Attention,
                logits_rows: Ints | None = None) -> Logits:
        raise AssertionError("a header-only model is planned, never run")


def estimated_weights_bytes(ckpt: Checkpoint, dtype: str) -> int:
    """An upper bound of the bytes the loaded model holds at `dtype` (the module doc's rule)."""
    total = MiB
    for info in ckpt.infos.values():
        if len(info.shape) != 2 or dtype == "float32":
            total += 4 * info.numel
        elif dtype == "bfloat16":
            total += 2 * info.numel
        else:
            per_weight = panel_bytes_per_weight(info.dtype)
            total += 4 * info.numel if per_weight is None else math.ceil(info.numel * per_weight)
    return total + total // 100


def header_details(ckpt: Checkpoint, mc: ModelConfig) -> dict[str, Any]:
    """What a model list shows of a model: family, file format, parameter count, its quantization
    (a GGUF's file type, e.g. Q4_K_M, as Ollama shows it; else the dtype most of its weights are
    stored in), its context length, where it is, its tensors' bytes, when the file changed, the
    sampling it recommends, and its chat template when the file holds one (a GGUF's)."""
    by_dtype: Counter[str] = Counter()
    for info in ckpt.infos.values():
        by_dtype[info.dtype] += info.numel
    template = ckpt.metadata.get("tokenizer.chat_template") if ckpt.format == "gguf" else None
    read = ckpt.container.get("header_from", ckpt.path)  # a model not joined yet: its first chunk
    code = ckpt.metadata.get("general.file_type") if ckpt.format == "gguf" else None
    file_type = FILE_TYPES.get(code) if type(code) is int else None
    return {"family": mc.model_type, "format": ckpt.format, "parameters": sum(by_dtype.values()),
            "quantization": file_type or (by_dtype.most_common(1)[0][0] if by_dtype else ""),
            "context": mc.max_position_embeddings,
            "path": ckpt.path, "size": sum(i.nbytes for i in ckpt.infos.values()),
            "mtime": os.stat(read).st_mtime, "sampling": recommended_sampling(ckpt),
            **({"template": template} if isinstance(template, str) else {})}


def model_need(ref: str, engine_options: dict[str, Any], budget_bytes: int) -> ModelNeed:
    """`ref`'s need (the module doc), planned within `budget_bytes`; MemoryPlanError if over."""
    ckpt = load_header(ref)  # a package model cut into chunks is not joined here, but by its load
    mc = read_config(Path(ckpt.path), ckpt)
    details = header_details(ckpt, mc)
    if not mc.is_decoder:
        weights = estimated_weights_bytes(ckpt, "float32")
        rows, T = EMBED_PLAN_ROWS, mc.max_position_embeddings
        act = 4 * rows * T * (6 * mc.hidden_size + mc.intermediate_size + mc.num_heads * T)
        return ModelNeed(ref, "embed", weights, 0, act, T, details)
    dtype = engine_options.get("dtype", "auto")
    weights = estimated_weights_bytes(ckpt, auto_dtype(ckpt, mc) if dtype == "auto" else dtype)
    options = {k: v for k, v in engine_options.items() if k not in ENGINE_ONLY}
    options.pop("memory_budget_bytes", None)
    left = budget_bytes - weights
    if left <= 0:
        raise MemoryPlanError(f"model '{ref}': its weights alone ({weights / MiB:.1f} MiB) exceed the "
                              f"{budget_bytes / MiB:.1f} MiB left of the budget")
    try:
        cfg = EngineConfig(**options, memory_budget_bytes=left)
    except TypeError as err:  # an option EngineConfig does not have
        raise ConfigError(f"engine option: {err}") from None
    ctx = min(mc.max_position_embeddings, cfg.max_model_len or mc.max_position_embeddings)
    draft = None
    spec = cfg.speculative
    if spec is not None and spec.model is not None:  # a draft model: its weights, KV and activations too
        draft_ckpt = load_header(spec.model)
        draft_mc = read_config(Path(draft_ckpt.path), draft_ckpt)
        draft = _HeaderModel(draft_mc)
        weights += estimated_weights_bytes(draft_ckpt, auto_dtype(draft_ckpt, draft_mc))
        cfg = EngineConfig(**options, memory_budget_bytes=budget_bytes - weights)
    try:
        plan = plan_memory(_HeaderModel(mc), cfg, ctx, weights_already_loaded=False, draft=draft)
    except MemoryPlanError as err:  # its figures count no weights: say whose they are, and the weights
        raise MemoryPlanError(f"model '{ref}' (weights {weights / MiB:.1f} MiB, planned apart): {err}") from None
    assert plan.weights_bytes == 0 and plan.draft_weights_bytes == 0, "a header-only model has no arrays to count"
    choice = context_choice(mc.max_position_embeddings, cfg.max_model_len, plan, cfg.block_size)
    draft_kv = plan.draft_kv_block_bytes * plan.num_draft_blocks  # the draft's pool, sized by the plan apart
    least = plan.kv_bytes_for(min(MIN_DEFAULT_CONTEXT, ctx), cfg.block_size) + draft_kv
    return ModelNeed(ref, "generate", weights, plan.kv_bytes + draft_kv,
                     plan.activation_bytes + plan.draft_activation_bytes, choice.used, details, choice, least)


@dataclass(frozen=True)
class SharedPlan:
    needs: tuple[ModelNeed, ...]
    budget_bytes: int

    @property
    def total_bytes(self) -> int:
        return sum(n.total_bytes for n in self.needs)

    def describe(self) -> str:
        return (" + ".join(n.describe() for n in self.needs)
                + f" = {self.total_bytes / MiB:.1f} MiB (budget {self.budget_bytes / MiB:.1f} MiB)")

    def engine_options(self, need: ModelNeed, engine_options: dict[str, Any]) -> dict[str, Any]:
        """A generator's engine options with its share of the budget as the engine's own."""
        assert need in self.needs
        return {**engine_options, "memory_budget_bytes": need.total_bytes}


def plan_models(refs: list[str], engine_options: dict[str, Any], budget_bytes: int | None = None) -> SharedPlan:
    """Every model's need, each planned against what the ones before it left; when that does not
    fit and the contexts are the defaults, each generator's KV pool gets a share of what the
    weights and activations leave instead (`_shared_pools`); a MemoryPlanError naming them all
    when they do not fit together even so."""
    budget = budget_bytes or available_bytes()
    try:
        return _plan_in_order(refs, engine_options, budget)
    except MemoryPlanError:
        if any(engine_options.get(k) is not None for k in SIZED_BY_OPTIONS) or len(refs) < 2:
            raise
        shared = _shared_pools(refs, engine_options, budget)
        if shared is None:
            raise
        return shared


SIZED_BY_OPTIONS = ("max_model_len", "num_kv_blocks", "kv_cache_memory_bytes")  # contexts and pools asked for


def _plan_in_order(refs: list[str], engine_options: dict[str, Any], budget: int,
                   caps: list[int] | None = None) -> SharedPlan:
    """Each model planned within what the ones before it left (and within its cap, if given)."""
    needs: list[ModelNeed] = []
    for i, ref in enumerate(refs):
        left = budget - sum(n.total_bytes for n in needs)
        try:
            needs.append(model_need(ref, engine_options, left if caps is None else min(left, caps[i])))
        except MemoryPlanError as err:
            before = "; the models before it plan " + " + ".join(n.describe() for n in needs) if needs else ""
            raise MemoryPlanError(f"the models do not fit in {budget / MiB:.1f} MiB: {err}{before}. Serve "
                                  "fewer models, lower --kv-cache-memory or --max-num-seqs, or raise --memory-budget"
                                  ) from None
    plan = SharedPlan(tuple(needs), budget)
    if plan.total_bytes > budget:
        raise MemoryPlanError(f"the models do not fit: {plan.describe()}")
    return plan


def _shared_pools(refs: list[str], engine_options: dict[str, Any], budget: int) -> SharedPlan | None:
    """The plan when the default KV pools (each up to memory_plan.DEFAULT_KV_BYTES) do not fit
    side by side: every generator first gets the pool of one sequence of the shortest default
    context (MIN_DEFAULT_CONTEXT, or the model's if shorter), then the room left is shared in
    proportion to what each pool would have been alone, and each context shrinks with its pool.
    None when a model alone does not fit (the in-order plan's error says so); a MemoryPlanError
    naming the --memory-budget that fits them all when even the shortest contexts do not."""
    try:
        alone = [model_need(ref, engine_options, budget) for ref in refs]
    except MemoryPlanError:
        return None
    least = sum(n.least_bytes for n in alone)
    if least > budget:
        figures = " + ".join(f"'{n.ref}' {n.least_bytes / MiB:.1f} MiB" for n in alone)
        raise MemoryPlanError(
            f"the models do not fit in {budget / MiB:.1f} MiB: with the shortest contexts a default gets "
            f"({MIN_DEFAULT_CONTEXT:,} tokens, or the model's if shorter) they need {least / MiB:.1f} MiB ({figures})."
            f" Raise --memory-budget to {math.ceil(least / MiB)}MiB, or serve fewer models")
    extra = sum(n.total_bytes - n.least_bytes for n in alone)
    share = 1.0 if extra <= 0 else min(1.0, (budget - least) / extra)
    caps = [n.least_bytes + int((n.total_bytes - n.least_bytes) * share) for n in alone]
    return _plan_in_order(refs, engine_options, budget, caps)
