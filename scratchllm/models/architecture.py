"""An architecture of the Llama family, described as data: what a checkpoint calls it, which pieces
its blocks have, how its config says the rest, and its tensors' names in both spellings.

The descriptions themselves are in models/architectures.py, one `Architecture` each. Everything
else reads them and never asks for an architecture by name: the config readers
(models/config.py) turn a config.json or GGUF metadata into a ModelConfig by the description's
rules, the loader (models/loader.py) maps GGUF names to Hugging Face names through `names`, the
packer (models/llama_pack.py) reads each role of a layer under its name, and the forward
(models/llama.py) and the fused C blocks (kernels/llama_blocks.pyx) run the pieces the
ModelConfig says the model has. GPT-2 and BERT are described too (`forward`), for the lookup
from a config.json to its forward pass; their config readers are their own.

A block, with the roles its tensors play (the names of models.llama.LayerParams):

    x += attn_out_norm?( o( attention( q_norm?(q), k_norm?(k), v ) ) )     q|k|v = qkv(attn_norm(x))
    x += mlp_out_norm?( down( act(gate) * up ) )                          gate|up = gate_up(mlp_norm(x))
"""

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

# role -> (Hugging Face name, GGUF name) of a tensor of block i, without the block's prefix
# ("model.layers.{i}." / "blk.{i}.") and without ".weight" / ".bias"
TensorNames = Mapping[str, tuple[str, str]]
# role -> (Hugging Face name, GGUF name) of a tensor outside the blocks, whole but for ".weight"
GLOBAL_NAMES: TensorNames = MappingProxyType({
    "embed": ("model.embed_tokens", "token_embd"),
    "final_norm": ("model.norm", "output_norm"),
    "lm_head": ("lm_head", "output"),
    "rope_freqs": ("rope_freqs", "rope_freqs"),  # Llama 3 GGUF: per-frequency divisors (no HF tensor)
})
HF_BLOCK, GGUF_BLOCK = "model.layers.{}.", "blk.{}."

LLAMA_NAMES: TensorNames = MappingProxyType({
    "attn_norm": ("input_layernorm", "attn_norm"),
    "q": ("self_attn.q_proj", "attn_q"),
    "k": ("self_attn.k_proj", "attn_k"),
    "v": ("self_attn.v_proj", "attn_v"),
    "o": ("self_attn.o_proj", "attn_output"),
    "q_norm": ("self_attn.q_norm", "attn_q_norm"),
    "k_norm": ("self_attn.k_norm", "attn_k_norm"),
    "mlp_norm": ("post_attention_layernorm", "ffn_norm"),  # Llama's name for the MLP's input norm
    "gate": ("mlp.gate_proj", "ffn_gate"),
    "up": ("mlp.up_proj", "ffn_up"),
    "down": ("mlp.down_proj", "ffn_down"),
})
# the file stores q|k|v as one matrix and gate|up as one (llama.cpp keeps gate|up in ffn_up)
FUSED_NAMES: TensorNames = MappingProxyType({
    "qkv": ("self_attn.qkv_proj", "attn_qkv"),
    "gate_up": ("mlp.gate_up_proj", "ffn_up"),
})
# each sublayer's output normed too (Gemma 2/3): the file's post_attention_layernorm is then the
# attention output's norm, and the MLP's input norm is pre_feedforward_layernorm
SANDWICH_NAMES: TensorNames = MappingProxyType({
    "attn_out_norm": ("post_attention_layernorm", "post_attention_norm"),
    "mlp_norm": ("pre_feedforward_layernorm", "ffn_norm"),
    "mlp_out_norm": ("post_feedforward_layernorm", "post_ffw_norm"),
})

WINDOW_RULES = ("every", "pattern", "layer_types")
ACTIVATIONS = ("silu", "gelu_tanh")


@dataclass(frozen=True)
class Architecture:
    """One architecture: its names in checkpoints, and the data every reader of it branches on."""

    name: str  # ours, as docs, logs and errors say it
    hf_architectures: tuple[str, ...] = ()  # config.json "architectures" entries
    hf_model_type: str | None = None  # config.json "model_type"
    gguf_architecture: str | None = None  # GGUF general.architecture
    forward: str = "llama"  # the forward pass that runs it: "llama" (models/llama.py), "gpt2", "bert"

    # --- the block's pieces
    qk_norm: bool = False  # an RMSNorm over each head of q and of k, before the rotation
    sandwich_norms: bool = False  # each sublayer's output normed too, before the residual add
    biases: str = "attention_bias"  # "attention_bias": config.json's flag, q, k, v and o; "qkv": always q, k, v
    fused_projections: bool = False  # the file stores q|k|v and gate|up fused (FUSED_NAMES)
    activation: str = "silu"  # the gated MLP's, where config.json does not name one, and in GGUF files
    norm_offset: float = 0.0  # config.json files: RMSNorm scales by (norm_offset + w); GGUF files store the sum
    embed_scale: bool = False  # embeddings times sqrt(hidden_size)
    tied_embeddings: bool = False  # config.json's tie_word_embeddings where it does not say

    # --- attention
    softmax_scale_key: str | None = None  # config.json key s whose value gives the scale s ** -0.5 (else head_dim's)
    softcaps: bool = False  # reads attn_logit_softcapping (scores) and final_logit_softcapping (logits)
    # which layers slide, where config.json's layer_types does not say: "every" layer once a window
    # is set; "pattern": every window_pattern-th layer attends to everything (the config's
    # sliding_window_pattern, GGUF attention.sliding_window_pattern, overrides); "layer_types":
    # only those layer_types names (GGUF files: none)
    windows: str = "every"
    window_pattern: int = 0
    local_rope: bool = False  # sliding-window layers rotate by a base of their own (rope_local_base_freq)

    # --- GGUF files, as llama.cpp's converter writes them
    gguf_permuted_rope_rows: bool = False  # q/k rows reordered for llama.cpp's adjacent-pair rotation
    gguf_scale_by_hidden: tuple[int, ...] = ()  # depths llama.cpp scales by 1 / sqrt(hidden / heads)

    # role -> (HF name, GGUF name); FUSED_NAMES and SANDWICH_NAMES are added where the pieces say so
    names: TensorNames = field(default_factory=lambda: LLAMA_NAMES)

    def __post_init__(self) -> None:
        assert self.forward in ("llama", "gpt2", "bert"), self.forward
        assert self.biases in ("attention_bias", "qkv"), self.biases
        assert self.windows in WINDOW_RULES, self.windows
        assert self.activation in ACTIVATIONS, self.activation
        assert (self.windows == "pattern") == (self.window_pattern > 0), "a pattern names its period"
        names = dict(self.names)
        if self.fused_projections:
            names |= FUSED_NAMES
        if self.sandwich_norms:
            names |= SANDWICH_NAMES
        object.__setattr__(self, "names", names)  # a plain dict: a ModelConfig pickles (Ray, copies)

    def __hash__(self) -> int:  # a ModelConfig holds one; the name says which
        return hash(self.name)


def layer_roles(arch: Architecture, qkv_bias: bool, o_bias: bool) -> list[tuple[str, str]]:
    """The tensors of one block, as (role, "weight" or "bias"), for a model of `arch` with or
    without biases: what the packer reads and every GGUF block tensor may be."""
    roles = ["attn_norm"]
    roles += ["qkv"] if arch.fused_projections else ["q", "k", "v"]
    roles += ["o"] + (["q_norm", "k_norm"] if arch.qk_norm else [])
    roles += ["mlp_norm"] + (["gate_up"] if arch.fused_projections else ["gate", "up"]) + ["down"]
    roles += ["attn_out_norm", "mlp_out_norm"] if arch.sandwich_norms else []
    out = [(r, "weight") for r in roles]
    if qkv_bias:
        out += [(r, "bias") for r in (["qkv"] if arch.fused_projections else ["q", "k", "v"])]
    if o_bias:
        out.append(("o", "bias"))
    return out


def hf_name(arch: Architecture, layer: int, role: str, kind: str = "weight") -> str:
    """The Hugging Face name of block `layer`'s tensor of `role`: model.layers.3.self_attn.q_proj.weight."""
    return f"{HF_BLOCK.format(layer)}{arch.names[role][0]}.{kind}"


def global_name(role: str) -> str:
    """The Hugging Face name of a tensor outside the blocks: model.embed_tokens.weight, ..."""
    return f"{GLOBAL_NAMES[role][0]}.weight"


def gguf_to_hf_names(arch: Architecture, num_layers: int, qkv_bias: bool, o_bias: bool) -> dict[str, str]:
    """GGUF tensor name -> Hugging Face name, for every tensor a GGUF file of this model may hold."""
    names = {f"{gguf}.weight": f"{hf}.weight" for hf, gguf in GLOBAL_NAMES.values()}
    for layer in range(num_layers):
        for role, kind in layer_roles(arch, qkv_bias, o_bias):
            names[f"{GGUF_BLOCK.format(layer)}{arch.names[role][1]}.{kind}"] = hf_name(arch, layer, role, kind)
    return names
