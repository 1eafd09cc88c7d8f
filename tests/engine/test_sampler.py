"""The one sampling path (engine/sampler.py): several rows of one request in one call draw what
one call per token draws (penalties, min_tokens, the grammar guide and the rng all see the
earlier rows' tokens), and drafted tokens are verified up to the first one the draw rejects."""

from dataclasses import dataclass, field

import numpy as np
import pytest

from scratchllm.engine.fake import BYTE_TOKENS, FakeTokenizer
from scratchllm.engine.sampler import sample, verify
from scratchllm.sampling import SamplingParams, make_rng
from scratchllm.structured import GrammarCompiler

V = BYTE_TOKENS


@dataclass(eq=False)
class Seq:
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self):
        self.rng = make_rng(self.params)


@pytest.fixture(scope="module")
def compiler():
    return GrammarCompiler(FakeTokenizer(V))


def cases(compiler):
    yield SamplingParams(max_tokens=8, temperature=0.0, frequency_penalty=1.5, presence_penalty=0.5,
                         repetition_penalty=1.3)
    yield SamplingParams(max_tokens=8, temperature=0.8, seed=3, top_k=40, top_p=0.9, logit_bias={40: 2.0})
    yield SamplingParams(max_tokens=8, temperature=0.0, min_tokens=3, stop_token_ids=(7, 9), logprobs=3)
    yield SamplingParams(max_tokens=8, temperature=1.0, seed=5, grammar=compiler.json_object())


def rows_for(seed, n):
    """n rows of logits [n, V] that favour a few tokens strongly (so penalties matter)."""
    rng = np.random.default_rng(seed)
    rows = rng.standard_normal((n, V)).astype(np.float32)
    rows[:, [7, 9, 40, 41]] += 4.0
    return rows


@pytest.mark.parametrize("case", range(4))
def test_consecutive_rows_of_one_request_draw_what_one_call_per_token_draws(compiler, case):
    params = list(cases(compiler))[case]
    logits = rows_for(case, 5)
    one = Seq(params, [7, 40, 3])
    per_token = []
    for r in range(5):
        got = sample(logits[r : r + 1], [one])[0]
        one.output_token_ids.append(got.token)
        per_token.append(got)
    together = Seq(params, [7, 40, 3])
    other = Seq(SamplingParams(temperature=0.0), [1])
    # the request's five rows in one call, with another request's row in front
    drawn = sample(np.concatenate([logits[:1], logits]), [other, *[together] * 5])
    assert drawn[1:] == per_token
    assert len(set(t.token for t in per_token)) > 1 or case == 3, "the rows must not all agree, or this shows little"


def test_verify_keeps_drafts_up_to_the_first_rejected_one(compiler):
    params = SamplingParams(max_tokens=8, temperature=0.0, frequency_penalty=1.0, grammar=compiler.json_object())
    logits = rows_for(9, 4)
    reference = Seq(params, [5])
    drafted = sample(logits, [reference] * 4)  # what the drafts would be if every one were right
    ids = [t.token for t in drafted]
    assert sample(logits, [Seq(params, [5])] * 4) == drafted  # a fresh request draws the same

    right = Seq(params, [5])
    assert verify(logits, [right] * 4, [*ids[:3], None]) == drafted  # every draft accepted
    wrong = Seq(params, [5])
    drafts = [ids[0], ids[1] + 1, ids[2], None]  # the second draft is wrong: rows 3 and 4 are not drawn
    assert verify(logits, [wrong] * 4, drafts) == [*drafted[:2], None, None]
    # its grammar guide consumed exactly the tokens it keeps: the next draw continues from them
    wrong.output_token_ids += ids[:2]
    assert sample(logits[2:3], [wrong]) == drafted[2:3]
