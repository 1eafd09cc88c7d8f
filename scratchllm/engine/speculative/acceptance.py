"""Which drafted tokens a request keeps: the acceptance rules of speculative decoding, as pure
functions of the target's distributions, the draft's and the drafts.

A verification step computes the target's logits after the last accepted token and after each of
the k drafted ones: k + 1 rows. Row i is the target's next-token distribution p_i given the
drafts before i; the draft proposed d_i from its own distribution q_i (row i of the draft).

Greedy (temperature 0): accept d_i while it is the target's argmax of row i; the first row whose
argmax differs gives the target's token instead, and when all k are accepted row k gives one
more. The output is the target's greedy output exactly: every emitted token is an argmax of
the target's logits after the tokens before it.

Sampled (Leviathan et al. 2023; Chen et al. 2023): accept d_i with probability
min(1, p_i(d_i) / q_i(d_i)); on rejection draw from the residual norm(max(0, p_i - q_i)) and stop;
when all k are accepted draw one more token from p_k. Each emitted token is then distributed as
the target's p given the tokens before it (the papers' theorem; tests/engine/speculative check
it by a chi-square test). p is what the request's sampling path draws from: its processed,
masked, temperature-scaled and filtered distribution (sampling.filtered_probs of
sampling.shaped_logits), so penalties, bias, grammar, top-k/top-p/min-p all hold.

A draft that is one token rather than a distribution (an n-gram's, or any deterministic guess) is
q = the point mass at d: accept with probability p(d), else draw from p without d. Drawing x from
p and keeping d when x == d is that same rule (P(x = d) = p(d); given x != d, x follows p without
d, renormalized), and it spends the request's random numbers exactly as decoding without a draft
does: one uniform per emitted token, drawn by the same inverse CDF. So a seeded request samples
the same tokens with or without n-gram speculation. `accept_draft` takes this path when q is None.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from scratchllm.sampling import draw

Probs = npt.NDArray[np.floating[Any]]  # one distribution [V] (need not be normalized)


def greedy_accepted(target: Sequence[int], drafts: Sequence[int]) -> int:
    """How many drafts the target's greedy tokens accept: target[i] is its argmax of row i
    (after drafts[:i]); the count of leading i with target[i] == drafts[i]."""
    m = 0
    for t, d in zip(target, drafts, strict=False):
        if int(t) != int(d):
            break
        m += 1
    return m


def greedy_verify(target: Sequence[int], drafts: Sequence[int]) -> list[int]:
    """The tokens a greedy request emits: the accepted drafts and then the target's own token
    (target has len(drafts) + 1 rows). Equal to target[: accepted + 1]."""
    assert len(target) == len(drafts) + 1, (len(target), len(drafts))
    return [int(t) for t in target[: greedy_accepted(target, drafts) + 1]]


def residual(p: Probs, q: Probs) -> npt.NDArray[np.float64]:
    """norm(max(0, p - q)) unnormalized: where the target wants more than the draft offered."""
    return np.maximum(np.asarray(p, dtype=np.float64) / np.sum(p) - np.asarray(q, dtype=np.float64) / np.sum(q), 0.0)


def accept_draft(p: Probs, draft: int, q: Probs | None, rng: np.random.Generator) -> tuple[int, bool]:
    """One drafted position: (the token emitted here, whether it is the draft).

    q None: the draft is a point mass (draw from p, keep the draft if the draw is it). Else
    q is the distribution the draft was drawn from, with q[draft] > 0."""
    if q is None:
        x = draw(np.asarray(p, dtype=np.float64), rng)
        return x, x == int(draft)
    pd, qd = float(p[draft]) / float(np.sum(p)), float(q[draft]) / float(np.sum(q))
    assert qd > 0.0, "a draft drawn from q has q(draft) > 0"
    if rng.random() * qd < pd:  # u < p(d) / q(d): accepted with probability min(1, p/q)
        return int(draft), True
    r = residual(p, q)
    if not r.sum() > 0.0:  # p <= q everywhere means p == q, where rejection has probability 0
        r = np.asarray(p, dtype=np.float64)
    return draw(r, rng), False


def speculative_sample(p_rows: Sequence[Probs], drafts: Sequence[int], q_rows: Sequence[Probs] | None,
                       rng: np.random.Generator) -> list[int]:
    """A whole verification of one request: p_rows [k + 1] target rows, drafts [k], q_rows [k]
    draft rows (None: point masses). Returns the 1..k + 1 tokens emitted."""
    assert len(p_rows) == len(drafts) + 1 and (q_rows is None or len(q_rows) == len(drafts))
    out: list[int] = []
    for i, d in enumerate(drafts):
        token, ok = accept_draft(p_rows[i], d, None if q_rows is None else q_rows[i], rng)
        out.append(token)
        if not ok:
            return out
    out.append(draw(np.asarray(p_rows[len(drafts)], dtype=np.float64), rng))
    return out
