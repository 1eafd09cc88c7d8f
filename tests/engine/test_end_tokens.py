"""Every token that ends generation ends it, on the continuous engine and the static baseline
(the output path takes the tokenizer's set, engine/output.py); ignore_eos turns them all off, and
min_tokens holds them all back (the sampling path masks the set, engine/sampler.py)."""

import pytest

from scratchllm.engine import AsyncEngine, EngineConfig, LLMEngine
from scratchllm.engine.static import StaticEngine
from scratchllm.sampling import SamplingParams

from .test_async_engine import LetterTokenizer
from .tiny import tiny_llama

PROMPT = [5, 9, 14, 3, 7]


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=7)


def greedy(n, **kw):
    return SamplingParams(max_tokens=n, temperature=0.0, **kw)


def run(engine, params):
    events = list(engine.submit(PROMPT, params))
    return [e.token_id for e in events if e.token_id is not None], events


def engines(model, tokenizer):
    return {"continuous": AsyncEngine(LLMEngine(model, EngineConfig(num_kv_blocks=64), tokenizer=tokenizer)),
            "static": StaticEngine(model, tokenizer, batch_size=2)}


@pytest.mark.parametrize("kind", ["continuous", "static"])
def test_an_end_token_that_is_not_the_eos_ends_generation(model, kind):
    plain = engines(model, LetterTokenizer())[kind]
    ids, _ = run(plain, greedy(12))
    plain.shutdown()
    end = ids[3]  # a token the model writes, named an end token besides an EOS it never writes
    eos = next(t for t in range(97) if t not in ids)
    tokenizer = LetterTokenizer()
    tokenizer.eos_token_id, tokenizer.end_token_ids = eos, frozenset({eos, end})
    engine = engines(model, tokenizer)[kind]
    try:
        stopped, events = run(engine, greedy(12))
        cut = ids.index(end)
        assert stopped == ids[: cut + 1] and events[-1].finish_reason == "stop" and events[-1].text == ""
        assert run(engine, greedy(12, ignore_eos=True))[0] == ids  # ignore_eos: none of them ends it
        held, _ = run(engine, greedy(12, min_tokens=cut + 3))
        assert len(held) >= cut + 3 and end not in held[: cut + 3]  # min_tokens: every end token held back
    finally:
        engine.shutdown()
