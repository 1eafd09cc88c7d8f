"""The engine on the real default model (SmolLM2-135M-Instruct, Q4_1 GGUF): the greedy continuation
that llama.cpp and transformers both produce for the capital-of-France chat prompt, alone and
inside a batch."""

import pytest

from scratchllm.engine import EngineConfig, LLMEngine
from scratchllm.sampling import SamplingParams

ANCHOR_PROMPT = [1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198]
ANCHOR_OUTPUT = [504, 3575, 282, 4649, 314, 7042, 30, 2]  # "The capital of France is Paris." <|im_end|>


@pytest.mark.slow
def test_default_model_anchor_reference_alone_and_batched():
    from scratchllm.models import load_model

    engine = LLMEngine(load_model("default"), EngineConfig(num_kv_blocks=128, max_num_batched_tokens=64))
    greedy = SamplingParams(max_tokens=12, temperature=0.0)
    (alone,) = engine.generate([ANCHOR_PROMPT], greedy)
    assert alone.token_ids == ANCHOR_OUTPUT and alone.finish_reason == "stop"
    # beside other requests, with its prefill chunked by the small token budget
    others = [[1, 4093, 198] + list(range(600, 600 + n)) for n in (5, 40, 90)]
    results = engine.generate(others + [ANCHOR_PROMPT], greedy)
    assert results[-1].token_ids == ANCHOR_OUTPUT
    assert engine.stats().kv_blocks_used == 0
