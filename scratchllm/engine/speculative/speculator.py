"""The engine's speculative side: before each step it drafts for the decoding requests, after it
it learns from what the target accepted.

    propose(decodes)            -> {request: Draft}: for the scheduler to verify this step
    verified(req, drafted, ...) after the step: the request's acceptance, the counters
    observe_step(rows, seconds) a step of decodes only: the cost of a row (draft_length.py)
    release(request_id)         a request left: its n-gram index, its draft KV, its counts

A request's acceptance estimate (draft_length.Acceptance) starts from the rate of drafts of the
same source over every request: for n-grams, the n of the match (a 2-token match in fresh text is
often chance, a 4-token one rarely), for a draft model one source.

Per step: nothing when `disable_by_batch_size` requests or more decode (the hard switch); else
each request's most drafts (the config's k, its tokens left before max_tokens, its positions left
before the context's end, and for n-grams what its lookup found), then the draft-length rule
(draft_length.plan) over the measured cost of the step's rows and draft forwards, with a short
probe for a request that has not drafted for a while (PROBE_INTERVAL), then the drafts
themselves: the n-gram proposals cut to length, or the draft model's forwards.

The cost of a step is measured on steps that only decode (a prefill chunk's rows cost more each,
and would make a draft row look dearer than it is): a moving average of the seconds of each size
of step seen (up to MEASURED_ROWS rows), and a fit seconds = fixed + per_row x rows for the
sizes not seen yet. Until a fit
with a slope exists, a row is taken to cost PRIOR_ROW_COST of the fixed part, and a draft forward
PRIOR_DRAFT_COST of it; a draft forward's measured cost (of one row per request: a forward that
catches a request's prompt up is a prefill, paid once) then replaces its prior.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy.typing as npt

from scratchllm.engine.request import Request
from scratchllm.engine.sampler import SampledToken
from scratchllm.engine.speculative.config import SpeculativeConfig
from scratchllm.engine.speculative.draft import Draft
from scratchllm.engine.speculative.draft_length import Acceptance, StepCost, plan
from scratchllm.engine.speculative.draft_model import DraftModel
from scratchllm.engine.speculative.ngram import NgramIndex
from scratchllm.engine.step_time import StepTimeModel

PRIOR_ROW_COST = 0.25  # a row's cost / the step's fixed cost, before any is measured
PRIOR_DRAFT_COST = 0.4  # a draft forward's / the target's fixed cost, before one is measured
PRIOR_RATE = 0.6  # the acceptance rate assumed before any verification
PRIOR_WEIGHT = 3.0  # positions the prior (the method's rate so far) counts for in a request's estimate
DECAY = 0.8  # a request's counts after each verification: the estimate follows the text
IDLE_DECAY = 0.99  # per step without a draft: the estimate drifts back toward the prior (a probe)
# a draft is verified only where its expected tokens per second beat the step's by this much: the
# cost fit and the acceptance estimate are estimates, and a wrong draft costs a row for nothing
MARGIN = 1.1
MEASURED_ROWS = 64  # steps of up to this many rows are timed by their size (the products' cost is not linear)
# A request the rule keeps from drafting is measured no more, and its estimate rests on the prior:
# after PROBE_INTERVAL steps without a draft it drafts PROBE_LENGTH tokens anyway (a probe). The
# interval doubles after each probe (up to PROBE_MAX_INTERVAL) and starts over only when the rule
# itself drafts again: a probe whose drafts are accepted but do not pay (a draft model that agrees
# with the target yet costs more than it saves) must not recur every PROBE_INTERVAL steps, as
# each one costs a short draft and, with a draft model, its catch-up over the steps since.
PROBE_INTERVAL = 16
PROBE_MAX_INTERVAL = 256
PROBE_LENGTH = 2


@dataclass
class SpecCounters:
    """Since start: verifications (drafts verified), tokens drafted, drafts accepted, tokens the
    verifications emitted (accepted + the target's own one each), and steps the batch-size switch
    turned speculation off."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    emitted_tokens: int = 0
    steps_disabled: int = 0


class Speculator:
    def __init__(self, config: SpeculativeConfig, max_model_len: int, draft: DraftModel | None = None,
                 end_token_ids: Collection[int] = ()) -> None:
        assert (draft is not None) == config.uses_draft_model
        self.config = config
        self.max_model_len = max_model_len
        self.end_token_ids = frozenset(end_token_ids)  # a draft is cut after one: nothing after it is ever emitted
        self.draft = draft
        self.indexes: dict[str, NgramIndex] = {}
        self.acceptance: dict[str, Acceptance] = {}
        self.overall = Acceptance()  # every request's, undecayed: the prior of a new one
        # by where a draft came from (the n of an n-gram match; 0: the draft model), every
        # request's, undecayed: a request's prior for a draft of that source
        self.by_source: dict[int, Acceptance] = {}
        self.sources: dict[str, int] = {}  # this step's source of each request's draft
        self.step_time = StepTimeModel()
        self.row_seconds: dict[int, float] = {}  # a decode-only step's seconds by its rows (moving averages)
        self.counters = SpecCounters()
        self.probes: dict[str, list[int]] = {}  # request id -> [steps without a draft, its probe interval]

    # --- before the step ---
    def propose(self, decodes: list[Request]) -> dict[Request, Draft]:
        cfg = self.config
        if not decodes:
            return {}
        if cfg.disable_by_batch_size is not None and len(decodes) >= cfg.disable_by_batch_size:
            self.counters.steps_disabled += 1
            self._idle(decodes)
            return {}
        k_max = cfg.num_speculative_tokens
        assert k_max is not None
        limits = [max(0, min(k_max, r.params.max_tokens - r.num_output_tokens - 1, self.max_model_len - r.num_tokens))
                  for r in decodes]
        proposals: list[list[int]] = []
        sources = [0] * len(decodes)
        if self.draft is None:
            found = [self._index(r).lookup(k) for r, k in zip(decodes, limits, strict=True)]
            proposals, sources = [p for p, _ in found], [n for _, n in found]
            limits = [len(p) for p in proposals]
        self.sources = {r.request_id: n for r, n in zip(decodes, sources, strict=True)}
        if cfg.adaptive:
            overall = self.overall.rate(PRIOR_RATE, PRIOR_WEIGHT)
            rates = []
            for r, n in zip(decodes, sources, strict=True):
                prior = self.by_source.get(n, Acceptance()).rate(overall, PRIOR_WEIGHT)
                rates.append(self.acceptance.setdefault(r.request_id, Acceptance()).rate(prior, PRIOR_WEIGHT))
            ks = plan(rates, limits, self.cost(), cfg.draft_min, MARGIN)
            ks = self._probe(decodes, limits, ks)
        else:
            ks = [k if k >= max(cfg.draft_min, 1) else 0 for k in limits]
        self._idle([r for r, k in zip(decodes, ks, strict=True) if k == 0])
        if self.draft is None:
            drafts = {r: Draft(p[:k]) for r, p, k in zip(decodes, proposals, ks, strict=True) if k}
        else:
            chosen = [(r, k) for r, k in zip(decodes, ks, strict=True) if k]
            made = self.draft.propose([r for r, _ in chosen], [k for _, k in chosen]) if chosen else []
            drafts = {r: d for (r, _), d in zip(chosen, made, strict=True) if d.tokens}
        drafts = {r: self._to_end(r, d) for r, d in drafts.items()}
        return {r: d for r, d in drafts.items() if d.tokens and len(d.tokens) >= cfg.draft_min}

    def _probe(self, decodes: list[Request], limits: list[int], ks: list[int]) -> list[int]:
        """ks with a probe for each request that has not drafted for its probe interval."""
        length = max(PROBE_LENGTH, self.config.draft_min)
        out = []
        for r, limit, k in zip(decodes, limits, ks, strict=True):
            state = self.probes.setdefault(r.request_id, [0, PROBE_INTERVAL])
            if k:  # the rule drafts: probes start over from the first interval when it stops
                state[:] = [0, PROBE_INTERVAL]
            else:
                state[0] += 1
                if state[0] >= state[1] and limit >= length:
                    k = length
                    state[:] = [0, min(2 * state[1], PROBE_MAX_INTERVAL)]
            out.append(k)
        return out

    def _to_end(self, req: Request, draft: Draft) -> Draft:
        """The draft up to its first end token (the request's stop tokens, the model's tokens that
        end generation unless it ignores them), included: the request would end there, so no later
        draft is emitted."""
        p = req.params
        for i, t in enumerate(draft.tokens):
            if t in p.stop_token_ids or (t in self.end_token_ids and not p.ignore_eos):
                return draft.head(i + 1)
        return draft

    def _index(self, req: Request) -> NgramIndex:
        index = self.indexes.get(req.request_id)
        if index is None:
            lo, hi = self.config.prompt_lookup_min, self.config.prompt_lookup_max
            assert lo is not None and hi is not None
            index = self.indexes[req.request_id] = NgramIndex(lo, hi)
        index.sync(req.token_ids)
        return index

    def _idle(self, reqs: list[Request]) -> None:
        for r in reqs:
            acc = self.acceptance.get(r.request_id)
            if acc is not None:
                acc.idle(IDLE_DECAY)

    def cost(self) -> StepCost:
        """The step's cost: fitted from decode-only steps, or the priors (see the module doc)."""
        m = self.step_time
        fit = m.fit()
        if fit is not None and fit[0] > 0:
            fixed, per_row = fit
        elif m.w > 0:  # steps seen, no slope yet: their mean time, split by the prior
            mean_rows, mean_s = m.sx / m.w, m.sy / m.w
            fixed = mean_s / (1 + PRIOR_ROW_COST * mean_rows)
            per_row = PRIOR_ROW_COST * fixed
        else:
            fixed, per_row = 1.0, PRIOR_ROW_COST
        per_draft = 0.0
        if self.draft is not None:
            measured = self.draft.draft_s
            per_draft = measured if measured is not None else PRIOR_DRAFT_COST * fixed
        return StepCost(fixed, per_row, per_draft, self.row_seconds)

    # --- after the step ---
    def verified(self, req: Request, drafted: int, accepted: int, emitted: int) -> None:
        """`req` verified `drafted` drafts, kept `accepted` of them and emitted `emitted` tokens."""
        c = self.counters
        c.drafts += 1
        c.draft_tokens += drafted
        c.accepted_tokens += accepted
        c.emitted_tokens += emitted
        req.spec_drafted += drafted
        req.spec_accepted += accepted
        self.acceptance.setdefault(req.request_id, Acceptance()).record(drafted, accepted, DECAY)
        self.overall.record(drafted, accepted, 1.0)
        self.by_source.setdefault(self.sources.get(req.request_id, 0), Acceptance()).record(drafted, accepted, 1.0)

    def observe_step(self, rows: int, seconds: float) -> None:
        """A step that only decoded (verifications included) computed `rows` rows in `seconds`."""
        self.step_time.observe(rows, seconds)
        if rows <= MEASURED_ROWS:
            old = self.row_seconds.get(rows)
            self.row_seconds[rows] = seconds if old is None else 0.8 * old + 0.2 * seconds


    def release(self, request_id: str) -> None:
        self.indexes.pop(request_id, None)
        self.acceptance.pop(request_id, None)
        self.probes.pop(request_id, None)
        if self.draft is not None:
            self.draft.release(request_id)


# --- the rows of a verifying step ---
def draft_rows(reqs: Sequence[Request], drafts: Mapping[Request, Draft]
               ) -> tuple[list[int | None], list[npt.NDArray[Any] | None] | None]:
    """For sampler.verify: each row's draft (the token the next row of its request was computed
    after; None on a request's last row) and the draft's distribution q of it (None: a point
    mass; the whole list None when no draft came from a distribution). `reqs` holds a verifying
    request on 1 + len(drafts) consecutive rows."""
    row_drafts: list[int | None] = []
    row_probs: list[npt.NDArray[Any] | None] = []
    any_probs = False
    i = 0
    while i < len(reqs):
        draft = drafts.get(reqs[i])
        if draft is None:
            row_drafts.append(None)
            row_probs.append(None)
            i += 1
            continue
        k = len(draft.tokens)
        row_drafts += [*draft.tokens, None]
        row_probs += [*(draft.probs if draft.probs is not None else [None] * k), None]
        any_probs = any_probs or draft.probs is not None
        i += k + 1
    assert len(row_drafts) == len(reqs)
    return row_drafts, row_probs if any_probs else None


def by_request(reqs: Sequence[Request], sampled: Sequence[SampledToken | None]
               ) -> Iterator[tuple[int, Request, list[SampledToken]]]:
    """(its first row, the request, its tokens in order) for each request of a step's rows: one
    token, or a verification's drawn rows (the ones before the first None)."""
    i = 0
    while i < len(reqs):
        req, start, tokens = reqs[i], i, []
        while i < len(reqs) and reqs[i] is req:
            token = sampled[i]
            if token is not None:
                tokens.append(token)
            i += 1
        yield start, req, tokens
