"""The one sampling path: rows of logits plus each row's request -> (token, logprob, top_logprobs).

Every engine takes this step through `sample` (the continuous engine's ModelRunner, the static
baseline's run_batch, the fake engine), so what a request asks of the draw is honoured alike
everywhere. For one row, in this order:

  logits processors    penalties and logit_bias (scratchllm/logits.py), when the params use any
  min_tokens           the end tokens masked until that many tokens exist
  grammar mask         the tokens the request's grammar allows next (scratchllm/structured)
  draw                 greedy (argmax, ties to the lowest id) or the filtered distribution
                       (temperature, top-k, top-p, min_p) with one uniform from the request's rng

Logprobs are the model's own, from the raw row: a masked token reports its real probability.
Rows of plain greedy requests (no processor, no grammar) share one argmax over the batch.

Several rows of one request in one call. A row's request may appear again on later rows of the
same call; each such row is the distribution of the token after the ones its earlier rows
gave. So row j of a request sees, as its output so far, the request's output plus the tokens
drawn for its rows before j: penalties count them, min_tokens counts them, the grammar guide
has consumed them (it is advanced once per drawn token), and the rng draws come in row order,
one uniform per sampled token, exactly as one call per token would. Speculative decoding
verifies drafted tokens this way: the rows after the last accepted token and after each drafted
one, with `drafts[i]` the token row i + 1 of the same request presupposes; once a row's token
differs from its draft, the request's later rows are not drawn (None), and the tokens the
request keeps are its drawn ones. With deterministic drafts this gives exactly the tokens (and
rng state) of one token per step. A sampled request's draft drawn from a distribution q (a draft
model's) is kept with probability min(1, p / q), else replaced by a draw from max(0, p - q)
(speculative/acceptance.py), p being the distribution this path draws from.

Invariant (grammar): after the call a request's guide has consumed its output plus the tokens
returned for it; the engine appends those same tokens, so the next call's sync is a no-op.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from functools import cached_property
from typing import NamedTuple, Protocol

import numpy as np
import numpy.typing as npt

from scratchllm.engine.speculative.acceptance import accept_draft
from scratchllm.sampling import SamplingParams, filtered_probs, make_rng, sample_token, shaped_logits, top_logprobs
from scratchllm.structured import GrammarMatcher, guide_for


class SampledToken(NamedTuple):
    token: int
    logprob: float | None  # the token's logprob under the raw logits; None when not asked for
    top_logprobs: list[tuple[int, float]] | None  # the params.logprobs most likely (id, logprob)


class SamplingState(Protocol):
    """What the sampler reads of a request (the engine's Request, the static baseline's and the
    fake engine's rows have it). Held by identity: the grammar guide is keyed by the object."""

    @property
    def params(self) -> SamplingParams: ...

    @property
    def prompt_token_ids(self) -> Sequence[int]: ...

    @property
    def output_token_ids(self) -> Sequence[int]: ...

    @property
    def rng(self) -> np.random.Generator: ...


class TokenLists:
    """SamplingState for a request kept as two lists, `prompt` and `output_token_ids` (the
    static baseline's and the fake engine's rows), with its own generator made on first use."""

    prompt: list[int]
    output_token_ids: list[int]
    params: SamplingParams

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.prompt

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @cached_property
    def rng(self) -> np.random.Generator:
        return make_rng(self.params)


def start_guide(seq: SamplingState) -> None:
    """Make the request's grammar guide now (if it has a grammar), so its first mask is computed
    while the prefill runs rather than when the first token is drawn."""
    if seq.params.grammar is not None:
        guide_for(seq)


def sample(logits: npt.NDArray[np.floating], seqs: Sequence[SamplingState],
           end_token_ids: Collection[int] = ()) -> list[SampledToken]:
    """One token per row: logits [R, V], seqs[r] the request row r belongs to (a request may
    have several consecutive rows; see the module doc). `end_token_ids`: the engine's tokens that
    end generation, which min_tokens holds back."""
    out = _draw(logits, seqs, None, end_token_ids)
    assert all(t is not None for t in out)
    return out  # type: ignore[return-value]  # no drafts: every row is drawn


def verify(logits: npt.NDArray[np.floating], seqs: Sequence[SamplingState], drafts: Sequence[int | None],
           draft_probs: Sequence[npt.NDArray[np.floating] | None] | None = None,
           end_token_ids: Collection[int] = ()) -> list[SampledToken | None]:
    """`sample` for drafted tokens: drafts[i] is the token row i + 1 of the same request was
    computed after (None on a request's last row), draft_probs[i] the distribution q it was
    drawn from (None: a point mass). A request's rows after its first token that differs from
    its draft are not drawn (None)."""
    assert len(drafts) == len(seqs) and (draft_probs is None or len(draft_probs) == len(seqs))
    return _draw(logits, seqs, drafts, end_token_ids, draft_probs)


def _draw(logits: npt.NDArray[np.floating], seqs: Sequence[SamplingState], drafts: Sequence[int | None] | None,
          end_token_ids: Collection[int],
          draft_probs: Sequence[npt.NDArray[np.floating] | None] | None = None) -> list[SampledToken | None]:
    assert logits.ndim == 2 and logits.shape[0] == len(seqs), (logits.shape, len(seqs))
    greedy = np.argmax(logits, axis=1) if len(seqs) else np.empty(0, dtype=np.int64)  # every plain greedy row
    drawn: dict[int, list[int]] = {}  # id(request) -> tokens drawn for its earlier rows in this call
    guides: dict[int, GrammarMatcher | None] = {}
    rejected: set[int] = set()  # requests whose drafted continuation ended in this call
    out: list[SampledToken | None] = []
    for r, seq in enumerate(seqs):
        key = id(seq)
        if key in rejected:
            out.append(None)
            continue
        params = seq.params
        earlier = drawn.setdefault(key, [])
        if key not in guides:  # once per request per call: brought in step with its output
            guides[key] = guide_for(seq) if params.grammar is not None else None
        guide = guides[key]
        q = draft_probs[r] if draft_probs is not None else None
        if params.uses_processors or guide is not None:
            output_ids = list(seq.output_token_ids) + earlier if earlier else seq.output_token_ids
            row = shaped_logits(logits[r], params, seq.prompt_token_ids, output_ids,
                                guide.allowed() if guide is not None else None, end_token_ids)
            token = int(np.argmax(row)) if params.greedy else _sampled(row, params, seq.rng, drafts, r, q)
        else:
            token = int(greedy[r]) if params.greedy else _sampled(logits[r], params, seq.rng, drafts, r, q)
        if guide is not None:
            guide.consume(token)  # and the next mask starts computing now
        earlier.append(token)
        if params.logprobs is not None:
            lp, top = top_logprobs(logits[r], token, params.logprobs)
            out.append(SampledToken(token, lp, top))
        else:
            out.append(SampledToken(token, None, None))
        if drafts is not None and drafts[r] is not None and drafts[r] != token:
            rejected.add(key)
    return out


def _sampled(row: npt.NDArray[np.floating], params: SamplingParams, rng: np.random.Generator,
             drafts: Sequence[int | None] | None, r: int, q: npt.NDArray[np.floating] | None) -> int:
    """A sampled row's token: the rejection rule where the row's draft came from a distribution q,
    else the plain draw (which verifies a point-mass draft: see the module doc)."""
    draft = drafts[r] if drafts is not None else None
    if draft is None or q is None:
        return sample_token(row, params, rng)
    return accept_draft(filtered_probs(row, params), draft, q, rng)[0]
