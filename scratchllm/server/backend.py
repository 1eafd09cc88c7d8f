"""The real backends: a model behind the AsyncEngine, and an encoder model for embeddings.

Loading happens once, before the socket opens: a model that does not fit is refused at start
by the engine's memory plan (never an OOM mid-traffic), and the first request pays no load.
"""

from scratchllm.errors import ConfigError
from scratchllm.server.app import ServedEmbedder, ServedModel


def load_model(ref: str, name: str, engine_options: dict) -> ServedModel:
    """`ref` (default, a .gguf, a folder) behind an AsyncEngine; engine_options go to EngineConfig.
    `batching="static"` serves the padded baseline instead (static_engine.py)."""
    from scratchllm.engine.async_engine import AsyncEngine
    from scratchllm.engine.engine import LLMEngine

    engine_options = dict(engine_options)
    dtype = engine_options.pop("dtype", "float32")
    if engine_options.pop("batching", "continuous") == "static":
        return _load_static(ref, name, engine_options, dtype)
    try:
        engine = LLMEngine.from_pretrained(ref, tokenizer=True, dtype=dtype, **engine_options)
    except TypeError as err:  # an option EngineConfig does not have
        raise ConfigError(f"engine option: {err}") from None
    if engine.tokenizer is None:
        raise ConfigError(f"model '{ref}' has no tokenizer: the server needs one for text prompts")
    return ServedModel(name, AsyncEngine(engine), engine.tokenizer, engine.max_model_len)


def _load_static(ref: str, name: str, options: dict, dtype: str = "float32") -> ServedModel:
    from scratchllm.models import load_model as load
    from scratchllm.server.static_engine import StaticEngine
    from scratchllm.tokenizer import Tokenizer

    unknown = set(options) - {"max_num_seqs", "max_model_len", "num_kv_blocks"}
    if unknown:
        raise ConfigError(f"--batching static does not take {sorted(unknown)}")
    engine = StaticEngine(load(ref, dtype=dtype), Tokenizer.from_pretrained(ref),
                          batch_size=options.get("max_num_seqs") or 8, max_model_len=options.get("max_model_len"))
    return ServedModel(name, engine, engine.tokenizer, engine.max_model_len)


def load_embedder(ref: str) -> ServedEmbedder:
    """An encoder model (BERT family, e.g. `minilm`) with `embed(input_ids, attention_mask)`."""
    from scratchllm.models import load_model as load
    from scratchllm.tokenizer import Tokenizer

    model = load(ref)
    if not hasattr(model, "embed"):
        raise ConfigError(f"--embedding-model '{ref}' is not an encoder model (it has no embeddings)")
    tokenizer = Tokenizer.from_pretrained(ref)
    max_len = min(model.config.max_position_embeddings, tokenizer.model_max_length or 1 << 30)
    return ServedEmbedder(ref, model.embed, tokenizer, max_len)
