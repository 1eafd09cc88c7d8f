"""A draft model: a smaller model of the target's vocabulary proposes the next tokens of each
request, k forwards of one row per request (batched over the requests that draft), in a KV pool
of its own.

Its cache follows each request lazily. `fed` is what the draft has computed K/V for; before a
proposal the tokens of `fed` that are no longer the request's (drafts the target rejected) are
dropped, and the request's tokens after them are fed in the first forward (the catch-up: a whole
prompt the first time, then the one or two tokens the last verification emitted). A request that
did not draft for a while catches up the same way. Every fed position holds the K/V of the token
the request has there, so a draft's numbers never depend on what was rejected before.

Greedy requests draft the draft model's argmax (stopping early where its probability is below
`p_min`, llama.cpp's --draft-p-min); sampled ones draw from the draft's filtered distribution q
(the request's temperature, top-k, top-p, min-p over the draft's logits) with a generator of the
draft's own, and keep q for the rejection rule (acceptance.py). Penalties and grammars shape
only the target's rows: a draft they would forbid is rejected there.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from scratchllm.engine.paged_attention import PagedAttention
from scratchllm.engine.request import Request
from scratchllm.engine.speculative.draft import Draft
from scratchllm.models.protocol import Model
from scratchllm.sampling import draw, filtered_probs

DRAFT_SEED = 0x5EED  # the draft generator of a seeded request: its seed mixed with this


@dataclass(eq=False)
class _Sequence:
    fed: list[int] = field(default_factory=list)  # tokens whose K/V the draft's pool holds, in order
    table: list[int] = field(default_factory=list)  # the draft pool's block ids
    rng: np.random.Generator | None = None


class DraftModel:
    def __init__(self, model: Model, num_blocks: int, block_size: int, num_threads: int = 0,
                 kv_dtype: str = "float32", p_min: float = 0.0) -> None:
        self.model = model
        self.block_size = block_size
        self.attention = PagedAttention.for_model(model.config, num_blocks, block_size, num_threads, kv_dtype=kv_dtype)
        self.free_blocks = list(range(num_blocks - 1, -1, -1))  # a stack: the lowest ids first
        self.num_blocks = num_blocks
        self.p_min = p_min
        self.seqs: dict[str, _Sequence] = {}
        # seconds of one draft position (a moving average; None before one): a proposal's whole
        # time (forwards, choosing, the catch-up of the one or two tokens the last verification
        # emitted) over its forwards; the draft-length rule's cost of a draft. A proposal that
        # catches a request up by more (a prompt, a stretch without drafts) is not counted: that
        # is a prefill, paid once.
        self.draft_s: float | None = None

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_blocks)

    def release(self, request_id: str) -> None:
        """A request left (finished, aborted): its draft blocks go back."""
        seq = self.seqs.pop(request_id, None)
        if seq is not None:
            self.free_blocks.extend(reversed(seq.table))

    def _sync(self, req: Request) -> _Sequence:
        seq = self.seqs.get(req.request_id)
        if seq is None:
            seq = self.seqs[req.request_id] = _Sequence()
            if req.params.seed is not None:
                seq.rng = np.random.default_rng([req.params.seed, DRAFT_SEED])
        tokens, fed = req.token_ids, seq.fed
        n = min(len(fed), len(tokens) - 1)  # the last token is never fed before its proposal
        i = n
        for j in range(max(0, n - 64), n):  # rejected drafts are at the end: compare the tail
            if fed[j] != tokens[j]:
                i = j
                break
        del fed[i:]
        return seq

    def _grow(self, seq: _Sequence, length: int) -> bool:
        """Blocks for `length` positions; False (nothing taken) if the pool has too few."""
        need = -(-length // self.block_size) - len(seq.table)
        if need > len(self.free_blocks):
            return False
        for _ in range(need):
            seq.table.append(self.free_blocks.pop())
        return True

    def propose(self, reqs: list[Request], lengths: list[int]) -> list[Draft]:
        """Up to lengths[i] draft tokens for each request (fewer where p_min stops it or the pool is full)."""
        start = time.perf_counter()
        drafts = [Draft(probs=None if r.params.greedy else []) for r in reqs]
        live: list[int] = []
        feeds: list[list[int]] = []
        for i, (req, k) in enumerate(zip(reqs, lengths, strict=True)):
            if k <= 0:
                continue
            seq = self._sync(req)
            catch_up = req.token_ids[len(seq.fed) :]
            if self._grow(seq, len(seq.fed) + len(catch_up) + k - 1):
                live.append(i)
                feeds.append(catch_up)
        regular = all(len(f) <= 2 for f in feeds)  # only what a verification emits to catch up
        forwards = 0
        while live:
            forwards += 1
            logits = self._forward([reqs[i] for i in live], feeds)
            nxt_live, nxt_feeds = [], []
            for row, i in enumerate(live):
                req, draft = reqs[i], drafts[i]
                token = self._choose(req, logits[row], draft)
                if token is None:
                    continue
                draft.tokens.append(token)
                if len(draft.tokens) < lengths[i]:
                    nxt_live.append(i)
                    nxt_feeds.append([token])
            live, feeds = nxt_live, nxt_feeds
        if forwards and regular:
            seconds = (time.perf_counter() - start) / forwards
            self.draft_s = seconds if self.draft_s is None else 0.8 * self.draft_s + 0.2 * seconds
        return drafts

    def _choose(self, req: Request, row: npt.NDArray[np.float32], draft: Draft) -> int | None:
        """The draft's next token from its logits row (None: p_min stops the draft here)."""
        params = req.params
        if params.greedy:
            token = int(np.argmax(row))
            if self.p_min > 0.0:
                top = 1.0 / float(np.exp(row.astype(np.float64) - float(row[token])).sum())
                if top < self.p_min:
                    return None
            return token
        q = filtered_probs(row, params)
        seq = self.seqs[req.request_id]
        if seq.rng is None:
            seq.rng = np.random.default_rng()
        token = draw(q, seq.rng)
        assert draft.probs is not None
        draft.probs.append(q.astype(np.float32))
        return token

    def _forward(self, reqs: list[Request], feeds: list[list[int]]) -> npt.NDArray[np.float32]:
        """One forward of the draft over each request's fed tokens; the logits of each one's last."""
        ids: list[int] = []
        pos: list[int] = []
        lens: list[int] = []
        rows: list[int] = []
        tables = []
        for req, feed in zip(reqs, feeds, strict=True):
            seq = self.seqs[req.request_id]
            c = len(seq.fed)
            ids += feed
            pos += range(c, c + len(feed))
            lens.append(len(feed))
            rows.append(len(ids) - 1)
            seq.fed += feed
            tables.append(seq.table)
        table = np.zeros((len(tables), max(len(t) for t in tables)), dtype=np.int32)
        for s, t in enumerate(tables):
            table[s, : len(t)] = t
        token_seq = np.repeat(np.arange(len(reqs), dtype=np.int32), lens)
        positions = np.asarray(pos, dtype=np.int64)
        self.attention.set_layout(table, token_seq, positions)
        logits: Any = self.model.forward(np.asarray(ids, dtype=np.int64), positions, self.attention,
                                         logits_rows=np.asarray(rows, dtype=np.int64))
        return np.asarray(logits, dtype=np.float32)
