"""Triage: each pair of outputs gets one class, tried in this order:

  identical       the same tokens and the same text;
  detokenization  the same text after Unicode NFKC normalization (e.g. full-width punctuation
                  tokenized differently), or the same text from different tokens;
  repetition      one side falls into an n-gram loop the other does not (a period of at most
                  `loop_max_period` tokens repeated `loop_min_repeats` times or more, covering at
                  least `loop_min_tokens`): the regression a broken KV block table causes;
  near-tie        at the first divergence each side's token is in the other's top-k, and within
                  `near_tie_gap` nats of the other's choice there, and the answers stay close
                  after it (token edit distance at most `near_tie_max_edit` of the longer one, or 2):
                  numeric drift between two almost equally likely tokens. Answers that part at a
                  near-tie and then say different things are semantic: an annotator reads them;
  semantic        everything else: what annotators look at;
  error           a side has no output (the request failed on a server).

The noise rule: the candidate is diffed against the primary, and the secondary (the primary
again) against the primary too. A request whose primary and secondary differ is noisy; its
candidate diff is kept but not sent for annotation. A class's candidate count counts only by
what exceeds the noise count, and is significant only when that excess is above both an
absolute share of all requests and a relative share of the noise count (Diffy's rule). In
deterministic mode any noise at all is a bug in the servers and is flagged as such.
"""

import enum
import logging
import unicodedata
from collections.abc import Hashable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from scratchllm.evaluate.diff import TokenDiff, token_diff
from scratchllm.evaluate.store import ROLES, Output, RunStore

logger = logging.getLogger(__name__)


class Klass(enum.StrEnum):
    IDENTICAL = "identical"
    DETOKENIZATION = "detokenization"
    REPETITION = "repetition"
    NEAR_TIE = "near-tie"
    SEMANTIC = "semantic"
    ERROR = "error"


@dataclass(frozen=True)
class TriageConfig:
    near_tie_gap: float = 0.5  # nats
    near_tie_max_edit: float = 0.25  # edit distance / longer answer's tokens, past which it is semantic
    loop_max_period: int = 16
    loop_min_repeats: int = 3
    loop_min_tokens: int = 8
    abs_threshold: float = 0.01  # excess over noise, as a share of all requests
    rel_threshold: float = 0.2  # excess over noise, as a share of the noise count


def repetition_loop(tokens: Sequence[Hashable], cfg: TriageConfig = TriageConfig()) -> tuple[int, int, int] | None:
    """(start, period, repeats) of the first n-gram loop in `tokens`, or None."""
    n = len(tokens)
    for start in range(n):
        for period in range(1, cfg.loop_max_period + 1):
            repeats = 1
            while (start + (repeats + 1) * period <= n
                   and tokens[start + repeats * period:start + (repeats + 1) * period]
                   == tokens[start:start + period]):
                repeats += 1
            if repeats >= cfg.loop_min_repeats and repeats * period >= cfg.loop_min_tokens:
                return start, period, repeats
    return None


def _units(a: Output, b: Output) -> tuple[Sequence[Hashable], Sequence[Hashable], str]:
    """What the diff compares: ids if both servers sent them, else token strings, else characters."""
    if a.token_ids is not None and b.token_ids is not None:
        return list(a.token_ids), list(b.token_ids), "token_id"
    if a.tokens and b.tokens:
        return list(a.tokens), list(b.tokens), "token"
    return list(a.text or ""), list(b.text or ""), "char"


def is_near_tie(a: Output, b: Output, i: int, gap: float) -> bool:
    """Each side's token at i is in the other's top-k, within `gap` nats of that side's own."""
    if i >= min(len(a.tokens), len(b.tokens), len(a.top_logprobs), len(b.top_logprobs)):
        return False
    ta, tb = a.tokens[i], b.tokens[i]
    top_a, top_b = dict(a.top_logprobs[i]), dict(b.top_logprobs[i])
    if tb not in top_a or ta not in top_b:
        return False
    own_a = a.logprobs[i] if a.logprobs[i] is not None else top_a.get(ta)
    own_b = b.logprobs[i] if b.logprobs[i] is not None else top_b.get(tb)
    if own_a is None or own_b is None:
        return False
    return own_a - top_a[tb] <= gap and own_b - top_b[ta] <= gap


def classify(a: Output, b: Output,
             cfg: TriageConfig = TriageConfig()) -> tuple[Klass, TokenDiff | None, dict[str, Any]]:
    """The class of the pair (a = the reference side), its diff and the evidence."""
    if not a.ok or not b.ok:
        return Klass.ERROR, None, {"errors": [a.error, b.error]}
    assert a.text is not None and b.text is not None  # both are ok
    ua, ub, unit = _units(a, b)
    strings = (a.tokens, b.tokens) if unit != "char" else (list(a.text), list(b.text))
    d = token_diff(ua, ub, strings[0], strings[1], a.text, b.text)
    detail = {"unit": unit, **{k: v for k, v in asdict(d).items() if k != "spans"}, "spans": list(d.spans)}
    if d.first_divergence is None and a.text == b.text:
        return Klass.IDENTICAL, d, detail
    if unicodedata.normalize("NFKC", a.text) == unicodedata.normalize("NFKC", b.text):
        return Klass.DETOKENIZATION, d, detail
    loops = repetition_loop(ua, cfg), repetition_loop(ub, cfg)
    if (loops[0] is None) != (loops[1] is None):
        detail["loop"] = {"side": "a" if loops[0] else "b", "start_period_repeats": loops[0] or loops[1]}
        return Klass.REPETITION, d, detail
    i = d.first_divergence
    close = d.edit_distance <= max(2, cfg.near_tie_max_edit * max(len(ua), len(ub)))  # 2: a re-split word
    if i is not None and unit != "char" and close and is_near_tie(a, b, i, cfg.near_tie_gap):
        return Klass.NEAR_TIE, d, detail
    return Klass.SEMANTIC, d, detail


def significant(candidate: int, noise: int, total: int, cfg: TriageConfig) -> bool:
    """Does a class's candidate count exceed its noise count by both thresholds?"""
    excess = candidate - noise
    if total == 0 or excess <= 0:
        return False
    return excess / total > cfg.abs_threshold and (noise == 0 or excess / noise > cfg.rel_threshold)


def triage_run(store: RunStore, cfg: TriageConfig = TriageConfig(), deterministic: bool = False) -> dict[str, Any]:
    """Classifies every request of a run into its diff table; returns (and stores) the summary."""
    counts = {k.value: {"candidate": 0, "noise": 0} for k in Klass}
    noisy_ids: list[int] = []
    for req in store.requests():
        outs = store.outputs(req["id"])
        # a replay stopped midway leaves roles without output: they count as errors
        primary, secondary, candidate = (outs.get(role, Output(error="not replayed")) for role in ROLES)
        klass, d, detail = classify(primary, candidate, cfg)
        noise, _, _ = classify(primary, secondary, cfg)
        noisy = noise != Klass.IDENTICAL
        if noisy:
            noisy_ids.append(req["id"])
        counts[klass.value]["candidate"] += 1
        counts[noise.value]["noise"] += 1
        store.put_diff(req["id"], klass.value, noise.value, d.first_divergence if d else None,
                       d.edit_distance if d else 0, noisy, detail)
    total = sum(c["candidate"] for c in counts.values())
    for name, c in counts.items():
        c["net"] = c["candidate"] - c["noise"]  # below 0: the candidate has fewer of these than the noise
        c["significant"] = name != Klass.IDENTICAL.value and significant(c["candidate"], c["noise"], total, cfg)
    summary = {"config": asdict(cfg), "deterministic": deterministic, "total": total, "classes": counts,
               "noisy_requests": noisy_ids, "server_bug": bool(deterministic and noisy_ids)}
    if summary["server_bug"]:
        logger.error("deterministic mode: %d requests differ between primary and secondary: a bug in the "
                     "servers (request ids %s)", len(noisy_ids), noisy_ids[:20])
    store.set_option("triage", summary)
    return summary
