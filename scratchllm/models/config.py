"""ModelConfig: the frozen shape of a model, read from config.json or from GGUF metadata.

One dataclass covers the three families we run. `family` picks the forward pass:
  "llama" - Llama, SmolLM, Mistral-style and Qwen2 (Qwen2 = Llama + q/k/v biases)
  "gpt2"  - GPT-2 (learned positions, LayerNorm, tanh GELU, Conv1D weights)
  "bert"  - BERT encoders (embeddings for retrieval)
"""

from collections.abc import Mapping
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
    "GPT2LMHeadModel": "gpt2",
    "GPT2Model": "gpt2",
    "BertModel": "bert",
    "BertForMaskedLM": "bert",
    "BertForPreTraining": "bert",
}
_HF_MODEL_TYPE = {"llama": "llama", "mistral": "llama", "qwen2": "llama", "gpt2": "gpt2", "bert": "bert"}


@dataclass(frozen=True)
class ModelConfig:
    family: str  # "llama" | "gpt2" | "bert"
    model_type: str  # the checkpoint's own name: "llama", "qwen2", "gpt2", "bert", ...
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
    hidden_act: str = "silu"
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

    def window(self, layer: int) -> int | None:
        """The sliding window of `layer` in tokens (a query at position p sees keys p - w + 1 .. p),
        or None when the layer sees the whole context."""
        w = self.layer_windows[layer] if self.layer_windows else 0
        return w or None

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
    # Llama family. transformers >= 5 keeps rope_theta inside "rope_parameters"; older files at top level.
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ConfigError(f"rope scaling {rope_type!r} is not supported (only plain RoPE)")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"activation {cfg.get('hidden_act')!r} is not supported (only SiLU/SwiGLU)")
    if cfg.get("use_sliding_window"):
        raise ConfigError("sliding-window attention is not supported")
    is_qwen2 = model_type == "qwen2"
    return ModelConfig(
        family=family, model_type=model_type, vocab_size=cfg["vocab_size"], hidden_size=hidden,
        num_layers=cfg["num_hidden_layers"], num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or hidden // heads, intermediate_size=cfg["intermediate_size"],
        norm_eps=cfg.get("rms_norm_eps", 1e-6), max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=is_qwen2 or bool(cfg.get("attention_bias", False)),
        o_bias=not is_qwen2 and bool(cfg.get("attention_bias", False)),
        mlp_bias=bool(cfg.get("mlp_bias", False)), hidden_act="silu",
        bos_token_id=cfg.get("bos_token_id"), eos_token_id=eos,
    )


def from_gguf_metadata(meta: Mapping[str, Any], has_output: bool, has_qkv_bias: bool) -> ModelConfig:
    """Read GGUF key/values (`{arch}.block_count`, ...). Only Llama-family files are run from GGUF.

    `has_output` tells whether the file has its own `output.weight` (absent = tied to the
    embeddings); `has_qkv_bias` whether `blk.0.attn_q.bias` exists (Qwen2).
    """
    arch = meta.get("general.architecture")
    if arch not in ("llama", "qwen2"):
        raise ConfigError(f"GGUF architecture {arch!r} is not supported (llama, qwen2)")

    def get(key: str, default: object = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise ConfigError(f"GGUF metadata lacks {arch}.{key}")
        return value

    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    head_dim = int(meta.get(f"{arch}.rope.dimension_count", hidden // heads))
    if head_dim != hidden // heads:
        raise ConfigError("partial rotary (rope.dimension_count != head size) is not supported")
    if meta.get(f"{arch}.rope.scaling.type", "none") not in ("none", "linear") or meta.get(
        f"{arch}.rope.scaling.factor", 1.0
    ) != 1.0:
        raise ConfigError("rope scaling is not supported")
    vocab = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens", []))
    return ModelConfig(
        family="llama", model_type=arch, vocab_size=int(vocab), hidden_size=hidden,
        num_layers=int(get("block_count")), num_heads=heads,
        num_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv", heads)), head_dim=head_dim,
        intermediate_size=int(get("feed_forward_length")),
        norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        max_position_embeddings=int(get("context_length")),
        rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        tie_word_embeddings=not has_output, qkv_bias=has_qkv_bias, hidden_act="silu",
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"), eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
    )
