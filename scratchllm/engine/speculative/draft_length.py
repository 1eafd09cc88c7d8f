"""How many tokens to draft for each decoding request this step: as many as pay.

A step that verifies k drafts of a request computes k more rows; if each draft is accepted with
probability a (given the ones before it were), the request emits 1 + a + a^2 + ... + a^k tokens
instead of 1 (Leviathan et al. 2023). The step's time grows by the rows' cost, and with a draft
model by the draft's forwards. So, for the whole step (every decoding request together):

    tokens(k) = sum over requests of (1 - a_i^(k_i + 1)) / (1 - a_i)
    seconds(k) = fixed + per_row * (rows of the step) + per_draft * (draft forwards)

`plan` picks the k_i by marginal gain: starting from no drafts, it adds the draft position with
the best chance of being emitted (a_i^(k_i + 1)) while that chance per second it adds beats the
step's tokens per second so far; a step whose rows are cheap (one stream, bound by reading the
weights) drafts long, a large batch (bound by arithmetic: each row costs its share) drafts little
or nothing, and a request whose drafts are rejected (a small) stops drafting. A draft forward
serves every request drafting at that depth, so its cost is shared by them.

Each request's a is estimated from its own verifications: positions tested = accepted + one for
the rejection that ended a verification (positions after it were not tested), counts decayed by
`decay` per verification so the estimate follows the text (an edit copies, then writes fresh),
and started from a prior (the method's rate so far over every request) worth `prior_weight`
positions. A request that stops drafting is not measured any more; its counts decay toward the
prior on every step it does not draft, so it is tried again after a while, as a probe.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


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
    """Seconds of a step: fixed + per_row x rows of the target + per_draft x draft forwards."""

    fixed: float
    per_row: float
    per_draft: float = 0.0


def expected_tokens(a: float, k: int) -> float:
    """Tokens a verification of k drafts emits on average, each accepted with probability a."""
    return float(k + 1) if a >= 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)


def plan(rates: Sequence[float], limits: Sequence[int], cost: StepCost, minimum: int = 0,
         margin: float = 1.0) -> list[int]:
    """The draft length of each request: rates[i] its acceptance estimate, limits[i] the most it
    may draft (the config's k, its proposal's length, its room left). `minimum`: a request drafts
    0 or at least this many (shorter drafts are not verified). Greedy by marginal gain (see the
    module doc): each round adds the best of (a) one more draft to a request, within the draft
    forwards already planned, and (b) one more draft forward, with one more draft for each of the
    requests it then serves that raise the gain (the likeliest first). An addition is made only
    if its tokens per second beat the step's by `margin` (> 1: drafting must pay by that much,
    against the estimates' error)."""
    n = len(rates)
    ks = [0] * n
    tokens, seconds = float(n), cost.fixed + cost.per_row * n
    depth = 0  # draft forwards so far: the longest draft

    def first(k: int) -> int:  # a request's next length: `minimum` at once, then one at a time
        return max(1, minimum) if k == 0 else k + 1

    while True:
        best: tuple[float, list[tuple[int, int]], float, float] | None = None  # (gain/s, raises, tokens, s)
        for i in range(n):  # (a) within the planned forwards
            k1 = first(ks[i])
            if k1 <= min(depth, limits[i]):
                de = expected_tokens(rates[i], k1) - expected_tokens(rates[i], ks[i])
                dt = cost.per_row * (k1 - ks[i])
                if dt > 0 and (best is None or de / dt > best[0]):
                    best = (de / dt, [(i, k1)], de, dt)
        level = max(depth + 1, minimum)  # (b) one more forward
        raises = sorted(((i, level) for i in range(n) if ks[i] < level <= limits[i] and first(ks[i]) <= level),
                        key=lambda r: -rates[r[0]])
        de, dt = 0.0, cost.per_draft * (level - depth)
        for j, (i, k1) in enumerate(raises):
            de += expected_tokens(rates[i], k1) - expected_tokens(rates[i], ks[i])
            dt += cost.per_row * (k1 - ks[i])
            if dt > 0 and (best is None or de / dt > best[0]):
                best = (de / dt, raises[: j + 1], de, dt)
        if best is None or best[0] * seconds <= tokens * margin:  # it would not raise tokens per second enough
            return ks
        for i, k1 in best[1]:
            ks[i] = k1
            depth = max(depth, k1)
        tokens += best[2]
        seconds += best[3]
