"""Forward passes in NumPy over Hugging Face-named weights (Llama family, GPT-2, BERT).

`load_model(ref)` returns a model with `.config`, `.weights` and either
`.forward(input_ids [N], positions [N], attention, logits_rows=None) -> logits` (decoders) or
`.embed(input_ids [B, T], attention_mask [B, T]) -> [B, hidden]` (BERT).
See docs/architecture.md, "models".
"""

from scratchllm.models.attention import ContiguousKVCache
from scratchllm.models.config import ModelConfig
from scratchllm.models.loader import load_model

__all__ = ["ContiguousKVCache", "ModelConfig", "load_model"]
