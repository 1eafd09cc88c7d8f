"""The `timings` object of replies (docs/openai-api.md, "Timings"): the engine's split of a
request's time from its RequestMetrics, and each token's times from its events' `elapsed`.
The server's own serialize / send time is measured where the bytes are made (sse.ChunkTrace)
and added by the handlers (generation.Generation).

All in milliseconds, rounded to the microsecond. A token's latency is the gap to the request's
previous token; for the first token, to its arrival (its time to first token), as the trace
ring's token records define it.
"""

from collections.abc import Sequence
from typing import Any

from scratchllm.engine.protocol import RequestMetrics, RequestOutput


def timings(metrics: RequestMetrics | None) -> dict[str, Any] | None:
    """llama.cpp-style per-response timings from the engine's RequestMetrics (None if absent)."""
    if metrics is None:
        return None
    decoded = max(metrics.completion_tokens - 1, 0)  # the first token comes out of prefill
    return {
        "queue_ms": round(metrics.queue_ms, 3),
        "prefill_ms": round(metrics.prefill_ms, 3),
        "decode_ms": round(metrics.decode_ms, 3),
        "prompt_tokens": metrics.prompt_tokens,
        "completion_tokens": metrics.completion_tokens,
        "prefill_tokens_per_s": _rate(metrics.prompt_tokens, metrics.prefill_ms),
        "decode_tokens_per_s": _rate(decoded, metrics.decode_ms),
        "ttft_ms": _since(metrics.arrival, metrics.first_token),
        "e2e_ms": _since(metrics.arrival, metrics.finished),
        # speculative decoding (llama.cpp's names): tokens drafted for the request and verified,
        # and those the model accepted; 0 without speculation
        "draft_n": metrics.spec_drafted,
        "draft_n_accepted": metrics.spec_accepted,
    }


def token_timings(index: int, elapsed: float, previous: float | None) -> dict[str, Any]:
    """A streamed chunk's per-token times (timings_per_token) for the token it carries, the
    request's `index`-th: tokens so far, when the engine produced it (ms since the request
    arrived) and its latency since the request's previous token (`previous`, its elapsed; the
    first token's latency is since arrival, its TTFT)."""
    return {"completion_tokens": index + 1, "token_ms": round(elapsed * 1e3, 3),
            "token_latency_ms": _latency_ms(elapsed, previous)}


def per_token_timings(elapsed: Sequence[float]) -> dict[str, list[float]]:
    """A non-streamed reply's per-token times: token_timings' two times, one list entry per token."""
    return {"token_ms": [round(t * 1e3, 3) for t in elapsed],
            "token_latency_ms": [_latency_ms(t, p) for t, p in zip(elapsed, [None, *elapsed[:-1]], strict=True)]}


def _latency_ms(elapsed: float, previous: float | None) -> float:
    return round((elapsed - (previous or 0.0)) * 1e3, 3)


def _since(start: float, end: float | None) -> float | None:
    return None if end is None else round((end - start) * 1e3, 3)


def _rate(n: int, ms: float) -> float | None:
    return round(n / (ms / 1e3), 2) if ms > 0 and n > 0 else None


def reply_timings(result: RequestOutput, per_token: bool) -> dict[str, Any] | None:
    """A non-streamed reply's `timings` (its first choice's), with the per-token lists if asked
    for; Generation.reply adds the serialization."""
    t = timings(result.metrics)
    if t is None or not per_token:
        return t
    return {**t, **per_token_timings(result.token_elapsed)}
