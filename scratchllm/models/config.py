"""ModelConfig: the frozen shape of a model, read from config.json or from GGUF metadata.

One dataclass covers the three forward passes we run. `family` picks the forward pass:
  "llama" - the decoders of one pre-norm, rotary, gated-MLP design: Llama 2/3, SmolLM, Mistral,
            Qwen2, Qwen3, Phi-3, Gemma 2 and Gemma 3, each described once in
            models/architectures.py (`arch`); the readers below turn a checkpoint's config into
            this dataclass by the description's rules, never by an architecture's name.
  "gpt2"  - GPT-2 (learned positions, LayerNorm, tanh GELU, Conv1D weights)
  "bert"  - BERT encoders (embeddings for retrieval)
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from scratchllm.errors import ConfigError
from scratchllm.models.architecture import Architecture
from scratchllm.models.architectures import ARCHITECTURES, LLAMA

ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeScaling:
    """How the rotary frequencies theta^(-2i/D) are stretched for a longer context.
    "linear": every frequency / factor. "llama3" (Llama 3.1+): low frequencies (wavelength above
    original_max_position_embeddings / low_freq_factor) / factor, high ones (below .. /
    high_freq_factor) kept, the band between interpolated."""

    kind: str  # "linear" | "llama3"
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.kind not in ("linear", "llama3"):
            raise ConfigError(f"rope scaling {self.kind!r} is not supported (supported: {', '.join(ROPE_TYPES)})")
        if self.factor <= 0 or (self.kind == "llama3" and self.high_freq_factor <= self.low_freq_factor):
            raise ConfigError(f"rope scaling {self} is not a valid stretch")


class NotBuilt(ConfigError):
    """A config field that names a piece no forward pass here builds (the MLP's biases, ...): the
    loader refuses the file with it as a FormatError naming the field, never runs it without."""


@dataclass(frozen=True)
class ModelConfig:
    family: str  # the forward pass: "llama" | "gpt2" | "bert" (arch.forward)
    model_type: str  # the checkpoint's own name: "llama", "qwen2", "gemma3_text", "gpt2", "bert", ...
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    norm_eps: float
    max_position_embeddings: int
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # biases on q, k, v (Qwen2; Llama's attention_bias)
    o_bias: bool = False  # a bias on o (Llama's attention_bias)
    hidden_act: str = "silu"  # the gated MLP's activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU, Gemma)
    type_vocab_size: int = 0  # BERT token types
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    # Attention as the engine's kernel and the model's own caches run it (the contract between
    # models/ and engine/paged_attention.py): per-layer sliding windows in tokens (0 = the layer
    # attends to the whole context; () = every layer does), the softmax scale (None: head_dim**-0.5)
    # and tanh soft-capping of the scores (None: off).
    layer_windows: tuple[int, ...] = ()
    attn_scale: float | None = None
    attn_softcap: float | None = None
    # The values of this checkpoint that its architecture's pieces take (models/llama.py applies
    # each where the papers put it); which pieces a block has is `arch`'s
    rope_scaling: RopeScaling | None = None  # None: plain RoPE
    rope_local_theta: float | None = None  # Gemma 3: the rope base of sliding-window layers (None: rope_theta)
    norm_weight_offset: float = 0.0  # RMSNorm scales by (offset + w): Gemma's config.json files store w (1.0)
    embed_scale: float | None = None  # embeddings times this (Gemma: sqrt(hidden_size))
    final_softcap: float | None = None  # logits = cap * tanh(logits / cap) (Gemma 2)
    arch: Architecture = LLAMA  # the description: the block's pieces and the tensors' names

    def __post_init__(self) -> None:
        if self.family not in ("llama", "gpt2", "bert"):
            raise ConfigError(f"unknown model family {self.family!r}")
        assert self.arch.forward == self.family, f"{self.arch.name} runs the {self.arch.forward} forward"
        # GQA: every key/value head serves the same number of query heads
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"{self.num_heads} attention heads do not divide into {self.num_kv_heads} kv heads")
        if self.family != "llama" and self.num_heads * self.head_dim != self.hidden_size:
            raise ConfigError(f"{self.num_heads} heads x {self.head_dim} != hidden size {self.hidden_size}")
        if self.layer_windows and (len(self.layer_windows) != self.num_layers or min(self.layer_windows) < 0):
            raise ConfigError(f"layer_windows needs one window >= 0 per layer ({self.num_layers}), "
                              f"got {self.layer_windows}")
        if self.family == "llama" and self.head_dim % 2:
            raise ConfigError(f"rotary embeddings need an even head_dim, got {self.head_dim}")
        if self.hidden_act not in (("silu", "gelu_tanh") if self.family == "llama" else ("gelu_tanh", "gelu")):
            raise ConfigError(f"activation {self.hidden_act!r} is not supported by the {self.family} forward")

    def window(self, layer: int) -> int | None:
        """The sliding window of `layer` in tokens (a query at position p sees keys p - w + 1 .. p),
        or None when the layer sees the whole context."""
        w = self.layer_windows[layer] if self.layer_windows else 0
        return w or None

    def rope_base(self, layer: int) -> float:
        """The rotary base of `layer`: Gemma 3's sliding-window layers have their own."""
        if self.rope_local_theta is not None and self.window(layer) is not None:
            return self.rope_local_theta
        return self.rope_theta

    @property
    def softmax_scale(self) -> float:
        return self.attn_scale if self.attn_scale is not None else self.head_dim ** -0.5

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def is_decoder(self) -> bool:
        return self.family != "bert"


def architecture_of(cfg: Mapping[str, Any]) -> Architecture:
    """The description of a config.json's architecture: by its "architectures", else its "model_type"."""
    names = cfg.get("architectures") or []
    for arch in ARCHITECTURES:
        if any(name in arch.hf_architectures for name in names):
            return arch
    for arch in ARCHITECTURES:
        if arch.hf_model_type is not None and cfg.get("model_type") == arch.hf_model_type:
            return arch
    supported = sorted(name for arch in ARCHITECTURES for name in arch.hf_architectures)
    raise ConfigError(f"unsupported architecture {names or cfg.get('model_type')!r}: we run " + ", ".join(supported))


def from_hf_config(cfg: Mapping[str, Any]) -> ModelConfig:
    """Read a Hugging Face config.json (already parsed)."""
    arch = architecture_of(cfg)
    model_type = cfg.get("model_type", arch.name)
    eos = cfg.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) else eos
    if arch.forward == "gpt2":
        n_embd, n_head = cfg["n_embd"], cfg["n_head"]
        act = cfg.get("activation_function", "gelu_new")
        if act not in ("gelu_new", "gelu_pytorch_tanh"):
            raise ConfigError(f"GPT-2 activation {act!r} is not supported (only tanh GELU)")
        return ModelConfig(
            family="gpt2", model_type=model_type, vocab_size=cfg["vocab_size"], hidden_size=n_embd,
            num_layers=cfg["n_layer"], num_heads=n_head, num_kv_heads=n_head, head_dim=n_embd // n_head,
            intermediate_size=cfg.get("n_inner") or 4 * n_embd, norm_eps=cfg.get("layer_norm_epsilon", 1e-5),
            max_position_embeddings=cfg.get("n_positions", 1024), tie_word_embeddings=True,
            hidden_act="gelu_tanh", bos_token_id=cfg.get("bos_token_id"), eos_token_id=eos, arch=arch,
        )
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    if arch.forward == "bert":
        if cfg.get("position_embedding_type", "absolute") != "absolute":
            raise ConfigError("BERT: only absolute position embeddings are supported")
        if cfg.get("hidden_act", "gelu") != "gelu":
            raise ConfigError(f"BERT activation {cfg.get('hidden_act')!r} is not supported (only erf GELU)")
        return ModelConfig(
            family="bert", model_type=model_type, vocab_size=cfg["vocab_size"], hidden_size=hidden,
            num_layers=cfg["num_hidden_layers"], num_heads=heads, num_kv_heads=heads, head_dim=hidden // heads,
            intermediate_size=cfg["intermediate_size"], norm_eps=cfg.get("layer_norm_eps", 1e-12),
            max_position_embeddings=cfg.get("max_position_embeddings", 512), hidden_act="gelu",
            type_vocab_size=cfg.get("type_vocab_size", 2), arch=arch,
        )
    return _hf_llama_family(cfg, arch, model_type, eos)


def _hf_rope(params: Mapping[str, Any], cfg: Mapping[str, Any]) -> tuple[float, RopeScaling | None]:
    """(rope base, scaling) of one rope_parameters / rope_scaling dict. transformers >= 5 keeps
    rope_theta inside "rope_parameters"; older files keep it at the top level."""
    kind = params.get("rope_type", params.get("type", "default"))
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    if params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ConfigError("partial rotary embeddings (partial_rotary_factor != 1) are not supported")
    if kind == "default":
        return theta, None
    if kind not in ROPE_TYPES:
        raise ConfigError(f"rope scaling {kind!r} is not supported (supported: {', '.join(ROPE_TYPES)})")
    return theta, RopeScaling(
        kind=kind, factor=float(params["factor"]), low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)))


def pattern_windows(window: int, pattern: int | Sequence[bool], layers: int, where: str) -> tuple[int, ...]:
    """Windows of `layers` layers where every `pattern`-th layer attends to everything (the rest
    slide by `window`), or, per layer, whether it slides; `where` names the source in errors."""
    if isinstance(pattern, (list, tuple)):
        if len(pattern) != layers:
            raise ConfigError(f"{where} has {len(pattern)} entries for {layers} layers")
        return tuple(window if slides else 0 for slides in pattern)
    period = int(pattern)  # type: ignore[arg-type]  # a count (GGUF keeps it as an integer)
    return tuple(window if (i + 1) % period else 0 for i in range(layers))


def _hf_windows(cfg: Mapping[str, Any], arch: Architecture, layers: int) -> tuple[int, ...]:
    """Per-layer sliding windows: config.json's layer_types where it has them (transformers >= 5
    writes them), else the architecture's rule (Architecture.windows)."""
    window = cfg.get("sliding_window") or 0
    types: Sequence[str] | None = cfg.get("layer_types")
    if types is None and arch.windows == "pattern":
        pattern = pattern_windows(window, cfg.get("sliding_window_pattern", arch.window_pattern), layers,
                                  "sliding_window_pattern")
        types = ["sliding_attention" if w else "full_attention" for w in pattern]
    elif types is None and arch.windows == "layer_types":
        if cfg.get("use_sliding_window"):
            raise ConfigError(f"{arch.name}: use_sliding_window without layer_types is not supported")
        types = ["full_attention"] * layers
    elif types is None:
        types = ["sliding_attention" if window else "full_attention"] * layers
    if len(types) != layers or set(types) - {"sliding_attention", "full_attention"}:
        raise ConfigError(f"layer_types {list(types)} are not {layers} of sliding_attention / full_attention")
    if "sliding_attention" in types and not window:
        raise ConfigError("layer_types has sliding_attention layers but sliding_window is not set")
    windows = tuple(window if t == "sliding_attention" else 0 for t in types)
    return windows if any(windows) else ()


def _hf_llama_family(cfg: Mapping[str, Any], arch: Architecture, model_type: str, eos: int | None) -> ModelConfig:
    hidden, heads, layers = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_hidden_layers"]
    if cfg.get("mlp_bias"):
        raise NotBuilt("mlp_bias: biases on the MLP's matrices are not built here")
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or arch.activation
    act = {"gelu_pytorch_tanh": "gelu_tanh"}.get(act, act)
    if act not in ("silu", "gelu_tanh"):
        raise ConfigError(f"activation {act!r} is not supported (silu, gelu_pytorch_tanh)")
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_local: float | None = None
    if "full_attention" in rope:  # transformers >= 5, with sliding layers: one rope per layer type
        theta, scaling = _hf_rope(rope["full_attention"], cfg)
        local_theta, local_scaling = _hf_rope(rope.get("sliding_attention", {"rope_theta": 10000.0}), cfg)
        if local_scaling is not None:
            raise ConfigError("rope scaling on sliding-window layers is not supported")
        rope_local = local_theta
    else:
        theta, scaling = _hf_rope(rope, cfg)
        if arch.local_rope:
            rope_local = float(cfg.get("rope_local_base_freq", 10000.0))
    head_dim = cfg.get("head_dim") or hidden // heads
    attention_bias = bool(cfg.get("attention_bias", False))
    scale_key = cfg.get(arch.softmax_scale_key) if arch.softmax_scale_key else None
    softcap = cfg.get("attn_logit_softcapping") if arch.softcaps else None
    final_softcap = cfg.get("final_logit_softcapping") if arch.softcaps else None
    return ModelConfig(
        family="llama", model_type=model_type, vocab_size=cfg["vocab_size"], hidden_size=hidden,
        num_layers=layers, num_heads=heads, num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=head_dim, intermediate_size=cfg["intermediate_size"],
        norm_eps=cfg.get("rms_norm_eps", 1e-6), max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        rope_theta=theta, tie_word_embeddings=bool(cfg.get("tie_word_embeddings", arch.tied_embeddings)),
        qkv_bias=arch.biases == "qkv" or attention_bias, o_bias=arch.biases == "attention_bias" and attention_bias,
        hidden_act=act, bos_token_id=cfg.get("bos_token_id"), eos_token_id=eos,
        layer_windows=_hf_windows(cfg, arch, layers),
        attn_scale=float(scale_key) ** -0.5 if scale_key else None,
        attn_softcap=float(softcap) if softcap else None,
        rope_scaling=scaling, rope_local_theta=rope_local, norm_weight_offset=arch.norm_offset,
        embed_scale=float(hidden) ** 0.5 if arch.embed_scale else None,
        final_softcap=float(final_softcap) if final_softcap else None, arch=arch,
    )


def gguf_architecture(meta: Mapping[str, Any]) -> Architecture:
    """The description of a GGUF file's general.architecture."""
    name = meta.get("general.architecture")
    for arch in ARCHITECTURES:
        if arch.gguf_architecture is not None and arch.gguf_architecture == name:
            return arch
    supported = ", ".join(a.gguf_architecture for a in ARCHITECTURES if a.gguf_architecture)
    raise ConfigError(f"GGUF architecture {name!r} is not supported ({supported})")


def from_gguf_metadata(meta: Mapping[str, Any], has_output: bool, has_qkv_bias: bool,
                       has_rope_freqs: bool = False) -> ModelConfig:
    """Read GGUF key/values (`{arch}.block_count`, ...), as llama.cpp's converter writes them
    (key names: gguf-py's constants.Keys). Only llama-family architectures are run from GGUF.

    `has_output` tells whether the file has its own `output.weight` (absent = tied to the
    embeddings); `has_qkv_bias` whether `blk.0.attn_q.bias` exists (Qwen2); `has_rope_freqs`
    whether the file stores Llama 3's stretched rope frequencies as `rope_freqs.weight` (the
    model divides the frequencies by them).
    """
    arch = gguf_architecture(meta)
    prefix = meta["general.architecture"]  # arch.gguf_architecture

    def get(key: str, default: object = None) -> Any:
        value = meta.get(f"{prefix}.{key}", default)
        if value is None:
            raise ConfigError(f"GGUF metadata lacks {prefix}.{key}")
        return value

    hidden, heads, layers = int(get("embedding_length")), int(get("attention.head_count")), int(get("block_count"))
    head_dim = int(get("attention.key_length", hidden // heads))
    if int(get("attention.value_length", head_dim)) != head_dim:
        raise ConfigError("keys and values of different sizes (attention.value_length) are not supported")
    if int(get("rope.dimension_count", head_dim)) != head_dim:
        raise ConfigError("partial rotary (rope.dimension_count != head size) is not supported")
    kind = get("rope.scaling.type", "none")
    factor = float(get("rope.scaling.factor", 1.0))
    scaling = None
    if kind == "linear" and factor != 1.0:
        scaling = RopeScaling(kind="linear", factor=factor)
    elif kind not in ("none", "linear"):
        raise ConfigError(f"GGUF rope scaling {kind!r} is not supported (none, linear; Llama 3's as rope_freqs)")
    if has_rope_freqs and scaling is not None:
        raise ConfigError("a GGUF file with both rope_freqs.weight and rope scaling is not supported")
    window = int(get("attention.sliding_window", 0))
    if arch.windows == "pattern":  # llama.cpp: every sliding_window_pattern-th layer is global
        windows = pattern_windows(window, get("attention.sliding_window_pattern", arch.window_pattern), layers,
                                  f"GGUF {prefix}: attention.sliding_window_pattern")
    elif arch.windows == "every":  # (llama: Mistral; its converted files rarely say so)
        windows = (window,) * layers
    elif window:
        raise ConfigError(f"GGUF {prefix}: sliding-window attention is not supported for this architecture")
    else:
        windows = ()
    # The softmax scale llama.cpp gives Gemma: 1 / sqrt(head size), but 1 / sqrt(hidden / heads) for
    # the 27B models (Gemma 2: 46 layers, Gemma 3: 62), whose query_pre_attn_scalar is that
    scale_by_hidden = layers in arch.gguf_scale_by_hidden
    softcap = float(get("attn_logit_softcapping", 0.0)) if arch.softcaps else 0.0
    final_softcap = float(get("final_logit_softcapping", 0.0)) if arch.softcaps else 0.0
    vocab = meta.get(f"{prefix}.vocab_size") or len(meta.get("tokenizer.ggml.tokens", []))
    return ModelConfig(
        family="llama", model_type=prefix, vocab_size=int(vocab), hidden_size=hidden,
        num_layers=layers, num_heads=heads,
        num_kv_heads=int(get("attention.head_count_kv", heads)), head_dim=head_dim,
        intermediate_size=int(get("feed_forward_length")),
        norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        max_position_embeddings=int(get("context_length")),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        tie_word_embeddings=not has_output, qkv_bias=has_qkv_bias, hidden_act=arch.activation,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"), eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        layer_windows=windows if any(windows) else (),
        attn_scale=(hidden / heads) ** -0.5 if scale_by_hidden else None,
        attn_softcap=softcap or None, final_softcap=final_softcap or None, rope_scaling=scaling,
        rope_local_theta=float(get("rope.freq_base_swa", 10000.0)) if arch.local_rope else None,
        norm_weight_offset=0.0,  # llama.cpp's converter stores offset + w
        embed_scale=float(hidden) ** 0.5 if arch.embed_scale else None, arch=arch,
    )
