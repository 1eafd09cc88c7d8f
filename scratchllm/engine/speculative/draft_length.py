"""How many tokens to draft for each decoding request this step: as many as pay.

A step that verifies k drafts of a request computes k more rows; if each draft is accepted with
probability a (given the ones before it were), the request emits 1 + a + a^2 + ... + a^k tokens
instead of 1 (Leviathan et al. 2023). The step's time grows by the rows' cost, and with a draft
model by the draft's forwards. So, for the whole step (every decoding request together):

    tokens(k) = sum over requests of (1 - a_i^(k_i + 1)) / (1 - a_i)
    seconds(k) = step(rows of the step) + per_draft * (draft forwards)

step(rows) is what steps of that many rows took (StepCost.seconds: measured ones where a step of
that size was seen, else fixed + per_row x rows). The products' cost is not linear in the rows
(a kernel's tile of rows fills at some count, and the next row starts a new one), so one
request's k is chosen by trying every k up to its limit. For several requests `plan` picks the
k_i by marginal gain: starting from no drafts, it adds the draft position with the best chance
of being emitted (a_i^(k_i + 1)) while that chance per second it adds beats the step's tokens
per second so far; a step whose rows are cheap (bound by reading the weights) drafts long, a
large batch (bound by arithmetic: each row costs its share) drafts little or nothing, and a
request whose drafts are rejected (a small) stops drafting. A draft forward serves every request
drafting at that depth, so its cost is shared by them.

Each request's a is estimated from its own verifications: positions tested = accepted + one for
the rejection that ended a verification (positions after it were not tested), counts decayed by
`decay` per verification so the estimate follows the text (an edit copies, then writes fresh),
and started from a prior (the method's rate so far over every request) worth `prior_weight`
positions. A request that stops drafting is not measured any more; its counts decay toward the
prior on every step it does not draft, so it is tried again after a while, as a probe.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field


@dataclass
class Acceptance:
    """One request's acceptance counts (decayed)."""

    accepted: float = 0.0
    tested: float = 0.0

    def rate(self, prior: float, prior_weight: float) -> float:
        return (self.accepted + prior * prior_weight) / (self.tested + prior_weight)

    def record(self, drafted: int, accepted: int, decay: float) -> None:
        """A verification of `drafted` drafts kept `accepted` of them."""
        assert 0 <= accepted <= drafted
        self.accepted = self.accepted * decay + accepted
        self.tested = self.tested * decay + accepted + (1 if accepted < drafted else 0)

    def idle(self, decay: float) -> None:
        """A step without drafts: what was measured fades toward the prior."""
        self.accepted *= decay
        self.tested *= decay


@dataclass(frozen=True)
class StepCost:
    """Seconds of a step: the target's step of `rows` rows (measured[rows] where known, else
    fixed + per_row x rows) + per_draft x draft forwards."""

    fixed: float
    per_row: float
    per_draft: float = 0.0
    measured: Mapping[int, float] = field(default_factory=dict)

    def seconds(self, rows: int) -> float:
        known = self.measured.get(rows)
        return known if known is not None else self.fixed + self.per_row * rows

    def added(self, rows: int, more: int) -> float:
        """Seconds `more` rows add to a step of `rows` (measured ends where both are, else the fit)."""
        a, b = self.measured.get(rows), self.measured.get(rows + more)
        return b - a if a is not None and b is not None else self.per_row * more


def expected_tokens(a: float, k: int) -> float:
    """Tokens a verification of k drafts emits on average, each accepted with probability a."""
    return float(k + 1) if a >= 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)


def plan(rates: Sequence[float], limits: Sequence[int], cost: StepCost, minimum: int = 0,
         margin: float = 1.0) -> list[int]:
    """The draft length of each request: rates[i] its acceptance estimate, limits[i] the most it
    may draft (the config's k, its proposal's length, its room left). `minimum`: a request drafts
    0 or at least this many (shorter drafts are not verified). A draft is planned only if it
    raises the step's tokens per second by `margin` (> 1: drafting must pay by that much, against
    the estimates' error). One request: every k tried; several: greedy by marginal gain (see the
    module doc), each round adding the best of (a) one more draft to a request, within the draft
    forwards already planned, and (b) one more draft forward, with one more draft for each of the
    requests it then serves that raise the gain (the likeliest first)."""
    if len(rates) == 1:
        return [_one(rates[0], limits[0], cost, minimum, margin)]
    n = len(rates)
    ks = [0] * n
    tokens, rows = float(n), n
    seconds = cost.seconds(rows)
    depth = 0  # draft forwards so far: the longest draft

    def first(k: int) -> int:  # a request's next length: `minimum` at once, then one at a time
        return max(1, minimum) if k == 0 else k + 1

    while True:
        best: tuple[float, list[tuple[int, int]], float, float] | None = None  # (gain/s, raises, tokens, s)
        for i in range(n):  # (a) within the planned forwards
            k1 = first(ks[i])
            if k1 <= min(depth, limits[i]):
                de = expected_tokens(rates[i], k1) - expected_tokens(rates[i], ks[i])
                dt = cost.added(rows, k1 - ks[i])
                if dt > 0 and (best is None or de / dt > best[0]):
                    best = (de / dt, [(i, k1)], de, dt)
        level = max(depth + 1, minimum)  # (b) one more forward
        raises = sorted(((i, level) for i in range(n) if ks[i] < level <= limits[i] and first(ks[i]) <= level),
                        key=lambda r: -rates[r[0]])
        de, more = 0.0, 0
        for j, (i, k1) in enumerate(raises):
            de += expected_tokens(rates[i], k1) - expected_tokens(rates[i], ks[i])
            more += k1 - ks[i]
            dt = cost.per_draft * (level - depth) + cost.added(rows, more)
            if dt > 0 and (best is None or de / dt > best[0]):
                best = (de / dt, raises[: j + 1], de, dt)
        if best is None or best[0] * seconds <= tokens * margin:  # it would not raise tokens per second enough
            return ks
        for i, k1 in best[1]:
            rows += k1 - ks[i]
            ks[i] = k1
            depth = max(depth, k1)
        tokens += best[2]
        seconds += best[3]


def _one(a: float, limit: int, cost: StepCost, minimum: int, margin: float) -> int:
    """One request's best k: the most tokens per second of every k in {0} and [minimum, limit]."""
    def speed(k: int) -> float:
        return expected_tokens(a, k) / (cost.seconds(1 + k) + cost.per_draft * k)

    base = speed(0)
    candidates = [k for k in range(max(1, minimum), limit + 1) if speed(k) > base * margin]
    return max(candidates, key=speed, default=0)
