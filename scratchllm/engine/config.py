"""EngineConfig: the engine's options, checked once at construction.

Lifetime: one per engine (the model has its frozen ModelConfig, each request its SamplingParams).
Every threshold of the priority policy (engine/policy.py) is an option here, so a test or an
operator can pin or change it.
"""

from dataclasses import dataclass
from typing import Any

from scratchllm.engine.kv_sizing import KV_DTYPE_CHOICES
from scratchllm.engine.speculative.config import SpeculativeConfig
from scratchllm.errors import ConfigError

# The admission policies (engine/policy.py), the one list every option that names one reads:
# EngineConfig.policy, `serve --policy`, `bench engine --policies`.
POLICY_NAMES = ("priority", "fcfs")


@dataclass(frozen=True)
class EngineConfig:
    # --- KV cache ---
    block_size: int = 16  # tokens per KV block
    num_kv_blocks: int | None = None  # None: sized by the memory plan from memory_budget_bytes
    memory_budget_bytes: int | None = None  # None: 4 GiB minus weights (see memory_plan)
    kv_cache_memory_bytes: int | None = None  # KV pool size; None: sized from the model and max_num_seqs
    enable_prefix_caching: bool = True
    # the K/V element type: one of kv_sizing.KV_DTYPE_CHOICES ("auto" is kv_sizing.DEFAULT_KV_DTYPE)
    kv_cache_dtype: str = "auto"
    # the prefix cache's residue beyond the blocks the work holds (block_pool.BlockPool.pop_free):
    # freed blocks keep their cached prefixes in memory that is resident anyway, and may grow it by
    # at most this much; None: as much as the most KV the work has held at once (the pool's
    # resident memory then stays within twice that peak)
    prefix_cache_memory_bytes: int | None = None
    # --- batching ---
    # sequences in one step: 16, chosen by measurement (docs/memory.md): against 64 on a burst of 48
    # requests, time per output token 0.38x, requests/s 0.95x, end-to-end p99 the same, TTFT p99 1.7x
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512  # the per-step token budget (decodes + prefill chunks)
    max_model_len: int | None = None  # None: the model's context length
    # time per output token to hold (seconds): each step's token budget is what the step-time model
    # predicts fits it (engine/step_time.py); None: max_num_batched_tokens and max_num_seqs only
    target_tpot_s: float | None = None
    # --- admission (engine/policy.py) ---
    policy: str = "priority"  # one of POLICY_NAMES: "priority" (two queues, tick, gate, aging) or "fcfs"
    tick_s: float = 0.010  # scheduling tick
    high_priority_max_tokens: int = 256  # max_tokens < this -> high queue
    utilization_gate: float = 0.80  # admit only below this utilization
    max_low_per_tick: int = 2  # low-queue admissions per tick
    aging_s: float = 2.0  # a low request waiting this long is promoted to the high queue
    max_priority_adjust_s: float = 2.0  # the priority hook's offsets are clamped to +-this
    # --- numerics ---
    num_threads: int = 0  # threads of the attention kernel (our pool, kernels/pool.pyx); 0 = the pool's count
    # --- speculative decoding (docs/speculative-decoding.md) ---
    # vLLM's speculative_config: a SpeculativeConfig, its dict or its JSON text (made a
    # SpeculativeConfig here); None: every step decodes one token per request
    speculative_config: SpeculativeConfig | dict[str, Any] | str | None = None

    def __post_init__(self) -> None:
        def need(name: str, ok: bool, rule: str) -> None:
            if not ok:
                raise ConfigError(f"engine option {name} must be {rule}, got {getattr(self, name)!r}")

        need("block_size", isinstance(self.block_size, int) and self.block_size >= 1, ">= 1")
        need("num_kv_blocks", self.num_kv_blocks is None or self.num_kv_blocks >= 1, ">= 1")
        need("memory_budget_bytes", self.memory_budget_bytes is None or self.memory_budget_bytes > 0, "> 0")
        need("kv_cache_memory_bytes", self.kv_cache_memory_bytes is None or self.kv_cache_memory_bytes > 0, "> 0")
        need("kv_cache_dtype", self.kv_cache_dtype in KV_DTYPE_CHOICES, f"one of {', '.join(KV_DTYPE_CHOICES)}")
        need("prefix_cache_memory_bytes", self.prefix_cache_memory_bytes is None or self.prefix_cache_memory_bytes >= 0,
             ">= 0")
        need("max_num_seqs", self.max_num_seqs >= 1, ">= 1")
        need("max_num_batched_tokens", self.max_num_batched_tokens >= 1, ">= 1")
        need("max_model_len", self.max_model_len is None or self.max_model_len >= 1, ">= 1")
        need("target_tpot_s", self.target_tpot_s is None or self.target_tpot_s > 0, "> 0")
        need("policy", self.policy in POLICY_NAMES, "one of " + ", ".join(POLICY_NAMES))
        need("tick_s", self.tick_s > 0, "> 0")
        need("high_priority_max_tokens", self.high_priority_max_tokens >= 1, ">= 1")
        need("utilization_gate", 0.0 < self.utilization_gate <= 1.0, "in (0, 1]")
        need("max_low_per_tick", self.max_low_per_tick >= 1, ">= 1")
        need("aging_s", self.aging_s > 0, "> 0")
        need("max_priority_adjust_s", self.max_priority_adjust_s >= 0, ">= 0")
        need("num_threads", self.num_threads >= 0, ">= 0 (0 = all cores)")
        object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """speculative_config, parsed (__post_init__ made it one)."""
        assert self.speculative_config is None or isinstance(self.speculative_config, SpeculativeConfig)
        return self.speculative_config
