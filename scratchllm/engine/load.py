"""A model reference -> the model and its tokenizer: the one loader under the engine
(LLMEngine.from_pretrained), the server (server/backend.py) and the cluster (cluster/app.py; its
replicas through LLMEngine.from_pretrained).

    load_weights(ref, dtype, tokenizer=True) -> (model, Tokenizer | None)
        the weights and the tokenizer from one parse of the file's header (a GGUF holds both)
    engine_limits(ref, engine_options) -> RequestLimits
        what an engine over `ref` with these EngineConfig options accepts (engine/validate.py):
        the longest sequence and the vocabulary, read from the model's config only
    load_frontend(ref, engine_options) -> (Tokenizer, RequestLimits)
        the tokenizer and those limits, without the weights: what a front end needs whose
        engines run elsewhere

`ref`: "default", "minilm", a .gguf file or a Hugging Face model folder (formats/refs.py).
"""

from __future__ import annotations

from typing import Any

from scratchllm.engine.config import EngineConfig
from scratchllm.engine.validate import RequestLimits
from scratchllm.errors import ConfigError
from scratchllm.formats import load_checkpoint
from scratchllm.formats.refs import resolve_model
from scratchllm.models import load_model
from scratchllm.models.loader import read_config
from scratchllm.tokenizer import Tokenizer


def load_weights(ref: str, dtype: str, tokenizer: bool = True) -> tuple[Any, Tokenizer | None]:
    """The model at `ref` (dtype: see scratchllm.dtypes) and, when asked, its tokenizer."""
    checkpoint = load_checkpoint(resolve_model(ref))  # one header parse for the model and its tokenizer
    model = load_model(ref, dtype=dtype, checkpoint=checkpoint)
    return model, Tokenizer.from_pretrained(ref, checkpoint=checkpoint) if tokenizer else None


def engine_limits(ref: str, engine_options: dict[str, Any], checkpoint: Any = None) -> RequestLimits:
    """The model's context, capped by max_model_len and by a fixed pool of num_kv_blocks (a
    sequence never outgrows the pool, as in LLMEngine), and its vocabulary size."""
    try:
        config = EngineConfig(**engine_options)
    except TypeError as err:  # an option EngineConfig does not have
        raise ConfigError(f"engine option: {err}") from None
    path = resolve_model(ref)
    model_config = read_config(path, checkpoint if checkpoint is not None else load_checkpoint(path))
    context: int = model_config.max_position_embeddings
    limit = min(context, config.max_model_len or context)
    if config.num_kv_blocks:
        limit = min(limit, config.num_kv_blocks * config.block_size)
    return RequestLimits(limit, model_config.vocab_size)


def load_frontend(ref: str, engine_options: dict[str, Any]) -> tuple[Tokenizer, RequestLimits]:
    """The tokenizer at `ref` and what an engine over it with these options accepts."""
    checkpoint = load_checkpoint(resolve_model(ref))  # one header parse for the config and the tokenizer
    return Tokenizer.from_pretrained(ref, checkpoint=checkpoint), engine_limits(ref, engine_options, checkpoint)
