"""The architectures we run, one description each (the fields: models/architecture.py).

Adding an architecture whose blocks are made of pieces already described (docs/architecture.md,
"Adding a model family"): one entry below, a test against transformers' logits, a row in
docs/model-files.md's table.
"""

from scratchllm.models.architecture import Architecture

LLAMA = Architecture(
    "llama", ("LlamaForCausalLM", "LlamaModel"), "llama", "llama", gguf_permuted_rope_rows=True)
MISTRAL = Architecture(
    "mistral", ("MistralForCausalLM",), "mistral")  # GGUF files say "llama"
QWEN2 = Architecture(
    "qwen2", ("Qwen2ForCausalLM", "Qwen2Model"), "qwen2", "qwen2", biases="qkv", windows="layer_types")
QWEN3 = Architecture(
    "qwen3", ("Qwen3ForCausalLM",), "qwen3", "qwen3", qk_norm=True, windows="layer_types")
PHI3 = Architecture(
    "phi3", ("Phi3ForCausalLM",), "phi3", "phi3", fused_projections=True)
GEMMA2 = Architecture(
    "gemma2", ("Gemma2ForCausalLM",), "gemma2", "gemma2", sandwich_norms=True, activation="gelu_tanh",
    norm_offset=1.0, embed_scale=True, tied_embeddings=True, softmax_scale_key="query_pre_attn_scalar",
    softcaps=True, windows="pattern", window_pattern=2, gguf_scale_by_hidden=(46,))
GEMMA3 = Architecture(
    "gemma3", ("Gemma3ForCausalLM",), "gemma3_text", "gemma3", qk_norm=True, sandwich_norms=True,
    activation="gelu_tanh", norm_offset=1.0, embed_scale=True, tied_embeddings=True,
    softmax_scale_key="query_pre_attn_scalar", softcaps=True, windows="pattern", window_pattern=6,
    local_rope=True, gguf_scale_by_hidden=(62,))
GEMMA = Architecture(
    "gemma", ("GemmaForCausalLM",), "gemma", activation="gelu_tanh", norm_offset=1.0, embed_scale=True,
    tied_embeddings=True)
GPT2 = Architecture("gpt2", ("GPT2LMHeadModel", "GPT2Model"), "gpt2", forward="gpt2")
BERT = Architecture("bert", ("BertModel", "BertForMaskedLM", "BertForPreTraining"), "bert", forward="bert")

ARCHITECTURES = (LLAMA, MISTRAL, QWEN2, QWEN3, PHI3, GEMMA, GEMMA2, GEMMA3, GPT2, BERT)
