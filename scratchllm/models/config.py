"""ModelConfig: the frozen shape of a model, read from config.json or from GGUF metadata.

One dataclass covers the three families we run. `family` picks the forward pass:
  "llama" - the decoders of one pre-norm, rotary, gated-MLP design: Llama 2/3, SmolLM, Mistral,
            Qwen2 (q/k/v biases), Qwen3 (QK-norm), Phi-3 (fused checkpoint matrices), Gemma 2 and
            Gemma 3 (sandwich norms, GeGLU, scaled embeddings, soft-capping, sliding windows).
            Their differences are the named fields below, each a small piece of models/llama.py.
  "gpt2"  - GPT-2 (learned positions, LayerNorm, tanh GELU, Conv1D weights)
  "bert"  - BERT encoders (embeddings for retrieval)
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from scratchllm.errors import ConfigError

# config.json "architectures" / "model_type" -> family
_HF_FAMILY = {
    "LlamaForCausalLM": "llama",
    "LlamaModel": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "llama",
    "Qwen2Model": "llama",
    "Qwen3ForCausalLM": "llama",
    "Phi3ForCausalLM": "llama",
    "Gemma2ForCausalLM": "llama",
    "Gemma3ForCausalLM": "llama",
    "GPT2LMHeadModel": "gpt2",
    "GPT2Model": "gpt2",
    "BertModel": "bert",
    "BertForMaskedLM": "bert",
    "BertForPreTraining": "bert",
}
_HF_MODEL_TYPE = {"llama": "llama", "mistral": "llama", "qwen2": "llama", "qwen3": "llama", "phi3": "llama",
                  "gemma2": "llama", "gemma3_text": "llama", "gpt2": "gpt2", "bert": "bert"}
# GGUF general.architecture values we run (all of the llama family)
GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3")
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


@dataclass(frozen=True)
class ModelConfig:
    family: str  # "llama" | "gpt2" | "bert"
    model_type: str  # the checkpoint's own name: "llama", "qwen2", "gemma3", "gpt2", "bert", ...
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
    qkv_bias: bool = False  # Qwen2: biases on q, k, v (not o)
    o_bias: bool = False  # Llama "attention_bias": biases on q, k, v and o
    mlp_bias: bool = False
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
    # The llama family's named variations (models/llama.py applies each where the papers put it)
    rope_scaling: RopeScaling | None = None  # None: plain RoPE
    rope_local_theta: float | None = None  # Gemma 3: the rope base of sliding-window layers (None: rope_theta)
    qk_norm: bool = False  # Qwen3, Gemma 3: RMSNorm over each head of q and k, before the rotation
    post_norms: bool = False  # Gemma 2/3: RMSNorm of each sublayer's output too, before the residual add
    norm_weight_offset: float = 0.0  # Gemma's RMSNorm scales by (1 + w): HF files store w (1.0); GGUF 1 + w (0)
    embed_scale: float | None = None  # Gemma: embeddings times sqrt(hidden_size)
    final_softcap: float | None = None  # Gemma 2: logits = cap * tanh(logits / cap)
    fused_checkpoint: bool = False  # Phi-3: the file stores qkv_proj and gate_up_proj fused

    def __post_init__(self) -> None:
        if self.family not in ("llama", "gpt2", "bert"):
            raise ConfigError(f"unknown model family {self.family!r}")
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
        if self.hidden_act not in ("silu", "gelu_tanh", "gelu"):
            raise ConfigError(f"activation {self.hidden_act!r} is not supported (silu, gelu_tanh)")

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


def from_hf_config(cfg: Mapping[str, Any]) -> ModelConfig:
    """Read a Hugging Face config.json (already parsed)."""
    archs = cfg.get("architectures") or []
    family = next((_HF_FAMILY[a] for a in archs if a in _HF_FAMILY), None)
    family = family or _HF_MODEL_TYPE.get(cfg.get("model_type", ""))
    if family is None:
        raise ConfigError(
            f"unsupported architecture {archs or cfg.get('model_type')!r}: we run "
            + ", ".join(sorted(_HF_FAMILY))
        )
    model_type = cfg.get("model_type", family)
    eos = cfg.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) else eos
    if family == "gpt2":
        n_embd, n_head = cfg["n_embd"], cfg["n_head"]
        act = cfg.get("activation_function", "gelu_new")
        if act not in ("gelu_new", "gelu_pytorch_tanh"):
            raise ConfigError(f"GPT-2 activation {act!r} is not supported (only tanh GELU)")
        return ModelConfig(
            family=family, model_type=model_type, vocab_size=cfg["vocab_size"], hidden_size=n_embd,
            num_layers=cfg["n_layer"], num_heads=n_head, num_kv_heads=n_head, head_dim=n_embd // n_head,
            intermediate_size=cfg.get("n_inner") or 4 * n_embd, norm_eps=cfg.get("layer_norm_epsilon", 1e-5),
            max_position_embeddings=cfg.get("n_positions", 1024), tie_word_embeddings=True,
            hidden_act="gelu_tanh", bos_token_id=cfg.get("bos_token_id"), eos_token_id=eos,
        )
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    if family == "bert":
        if cfg.get("position_embedding_type", "absolute") != "absolute":
            raise ConfigError("BERT: only absolute position embeddings are supported")
        if cfg.get("hidden_act", "gelu") != "gelu":
            raise ConfigError(f"BERT activation {cfg.get('hidden_act')!r} is not supported (only erf GELU)")
        return ModelConfig(
            family=family, model_type=model_type, vocab_size=cfg["vocab_size"], hidden_size=hidden,
            num_layers=cfg["num_hidden_layers"], num_heads=heads, num_kv_heads=heads, head_dim=hidden // heads,
            intermediate_size=cfg["intermediate_size"], norm_eps=cfg.get("layer_norm_eps", 1e-12),
            max_position_embeddings=cfg.get("max_position_embeddings", 512), hidden_act="gelu",
            type_vocab_size=cfg.get("type_vocab_size", 2),
        )
    return _hf_llama_family(cfg, model_type, eos)


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


def _hf_windows(cfg: Mapping[str, Any], model_type: str, layers: int) -> tuple[int, ...]:
    """Per-layer sliding windows: config.json's layer_types where it has them (transformers >= 5
    writes them), else each family's rule (Gemma 2 alternates, Gemma 3 has one full layer in
    sliding_window_pattern, Mistral and Phi-3 window every layer)."""
    window = cfg.get("sliding_window") or 0
    types: Sequence[str] | None = cfg.get("layer_types")
    if types is None:
        if model_type == "gemma2":
            types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
        elif model_type == "gemma3_text":
            pattern = int(cfg.get("sliding_window_pattern", 6))
            types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
        elif model_type in ("qwen2", "qwen3"):
            if cfg.get("use_sliding_window"):
                raise ConfigError(f"{model_type}: use_sliding_window without layer_types is not supported")
            types = ["full_attention"] * layers
        else:
            types = ["sliding_attention" if window else "full_attention"] * layers
    if len(types) != layers or set(types) - {"sliding_attention", "full_attention"}:
        raise ConfigError(f"layer_types {list(types)} are not {layers} of sliding_attention / full_attention")
    if "sliding_attention" in types and not window:
        raise ConfigError("layer_types has sliding_attention layers but sliding_window is not set")
    windows = tuple(window if t == "sliding_attention" else 0 for t in types)
    return windows if any(windows) else ()


def _hf_llama_family(cfg: Mapping[str, Any], model_type: str, eos: int | None) -> ModelConfig:
    hidden, heads, layers = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_hidden_layers"]
    gemma = model_type in ("gemma2", "gemma3_text")
    act = cfg.get("hidden_activation") or cfg.get("hidden_act", "silu")
    if act not in ("silu", "gelu_pytorch_tanh"):
        raise ConfigError(f"activation {act!r} is not supported (silu, gelu_pytorch_tanh)")
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_local: float | None = None
    if "full_attention" in rope:  # Gemma 3 in transformers >= 5: one rope per layer type
        theta, scaling = _hf_rope(rope["full_attention"], cfg)
        local_theta, local_scaling = _hf_rope(rope.get("sliding_attention", {"rope_theta": 10000.0}), cfg)
        if local_scaling is not None:
            raise ConfigError("rope scaling on sliding-window layers is not supported")
        rope_local = local_theta
    else:
        theta, scaling = _hf_rope(rope, cfg)
        if model_type == "gemma3_text":
            rope_local = float(cfg.get("rope_local_base_freq", 10000.0))
    head_dim = cfg.get("head_dim") or hidden // heads
    is_qwen2 = model_type == "qwen2"
    softcap = cfg.get("attn_logit_softcapping") if gemma else None
    return ModelConfig(
        family="llama", model_type=model_type, vocab_size=cfg["vocab_size"], hidden_size=hidden,
        num_layers=layers, num_heads=heads, num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=head_dim, intermediate_size=cfg["intermediate_size"],
        norm_eps=cfg.get("rms_norm_eps", 1e-6), max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        rope_theta=theta, tie_word_embeddings=bool(cfg.get("tie_word_embeddings", gemma)),
        qkv_bias=is_qwen2 or bool(cfg.get("attention_bias", False)),
        o_bias=not is_qwen2 and bool(cfg.get("attention_bias", False)),
        mlp_bias=bool(cfg.get("mlp_bias", False)), hidden_act="gelu_tanh" if act == "gelu_pytorch_tanh" else "silu",
        bos_token_id=cfg.get("bos_token_id"), eos_token_id=eos,
        layer_windows=_hf_windows(cfg, model_type, layers),
        attn_scale=float(cfg.get("query_pre_attn_scalar", 256)) ** -0.5 if gemma else None,
        attn_softcap=float(softcap) if softcap else None,
        rope_scaling=scaling, rope_local_theta=rope_local,
        qk_norm=model_type in ("qwen3", "gemma3_text"), post_norms=gemma,
        norm_weight_offset=1.0 if gemma else 0.0,
        embed_scale=float(hidden) ** 0.5 if gemma else None,
        final_softcap=float(cfg["final_logit_softcapping"]) if gemma and cfg.get("final_logit_softcapping") else None,
        fused_checkpoint=model_type == "phi3",
    )


def from_gguf_metadata(meta: Mapping[str, Any], has_output: bool, has_qkv_bias: bool,
                       has_rope_freqs: bool = False) -> ModelConfig:
    """Read GGUF key/values (`{arch}.block_count`, ...), as llama.cpp's converter writes them
    (key names: gguf-py's constants.Keys). Only llama-family architectures are run from GGUF.

    `has_output` tells whether the file has its own `output.weight` (absent = tied to the
    embeddings); `has_qkv_bias` whether `blk.0.attn_q.bias` exists (Qwen2); `has_rope_freqs`
    whether the file stores Llama 3's stretched rope frequencies as `rope_freqs.weight` (the
    model divides the frequencies by them).
    """
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ConfigError(f"GGUF architecture {arch!r} is not supported ({', '.join(GGUF_ARCHITECTURES)})")

    def get(key: str, default: object = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise ConfigError(f"GGUF metadata lacks {arch}.{key}")
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
    gemma = arch in ("gemma2", "gemma3")
    if arch == "gemma3":  # llama.cpp: every sliding_window_pattern-th layer (default 6) is global
        pattern = get("attention.sliding_window_pattern", 6)
        if isinstance(pattern, list):  # or, per layer, whether it slides
            if len(pattern) != layers:
                raise ConfigError(f"GGUF {arch}: attention.sliding_window_pattern has {len(pattern)} entries "
                                  f"for {layers} layers")
            windows = tuple(window if slides else 0 for slides in pattern)
        else:
            windows = tuple(window if (i + 1) % int(pattern) else 0 for i in range(layers))
    elif arch == "gemma2":  # llama.cpp: the even layers slide
        windows = tuple(window if i % 2 == 0 else 0 for i in range(layers))
    elif arch in ("phi3", "llama"):  # every layer (llama: Mistral; its converted files rarely say so)
        windows = (window,) * layers
    elif window:
        raise ConfigError(f"GGUF {arch}: sliding-window attention is not supported for this architecture")
    else:
        windows = ()
    # The softmax scale llama.cpp gives Gemma: 1 / sqrt(head size), but 1 / sqrt(hidden / heads) for
    # the 27B models (Gemma 2: 46 layers, Gemma 3: 62), whose query_pre_attn_scalar is that
    scale_by_hidden = (arch, layers) in (("gemma2", 46), ("gemma3", 62))
    softcap = float(get("attn_logit_softcapping", 0.0)) if arch == "gemma2" else 0.0
    final_softcap = float(get("final_logit_softcapping", 0.0)) if arch == "gemma2" else 0.0
    vocab = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens", []))
    return ModelConfig(
        family="llama", model_type=arch, vocab_size=int(vocab), hidden_size=hidden,
        num_layers=layers, num_heads=heads,
        num_kv_heads=int(get("attention.head_count_kv", heads)), head_dim=head_dim,
        intermediate_size=int(get("feed_forward_length")),
        norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        max_position_embeddings=int(get("context_length")),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        tie_word_embeddings=not has_output, qkv_bias=has_qkv_bias,
        hidden_act="gelu_tanh" if gemma else "silu",
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"), eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        layer_windows=windows if any(windows) else (),
        attn_scale=(hidden / heads) ** -0.5 if scale_by_hidden else None,
        attn_softcap=softcap or None, final_softcap=final_softcap or None, rope_scaling=scaling,
        rope_local_theta=float(get("rope.freq_base_swa", 10000.0)) if arch == "gemma3" else None,
        qk_norm=arch in ("qwen3", "gemma3"), post_norms=gemma,
        norm_weight_offset=0.0,  # llama.cpp's converter stores Gemma's norms as 1 + w
        embed_scale=float(hidden) ** 0.5 if gemma else None,
        fused_checkpoint=arch == "phi3",
    )
