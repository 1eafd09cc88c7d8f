"""One request's grammar state: the mask of allowed next tokens, and consume(token).

When a mask is computed: right after a token is consumed (and once at creation), the next
mask is started on a background thread, so it is computed while the engine finishes the step
and runs the next forward; llguidance releases the GIL while it computes, so the two overlap.
The next `allowed()` then only collects it. A step therefore never waits for a mask it could
have had earlier; `wait_s` against `compute_s` shows how much of the work stayed hidden.

Invariant: `num_consumed` tokens of the request's output have been fed to the matcher, in
order, and `sync(output_ids)` restores it for any output the engine holds (a request preempted
by recompute keeps its tokens, so its matcher stays valid and nothing is reset).
"""

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Protocol

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    import llguidance

Mask = npt.NDArray[np.bool_]  # [vocab_size] bool: True where the grammar allows the token

logger = logging.getLogger(__name__)

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            # One worker: masks of a batch are computed one after another while the forward runs
            # (the forward already has every core through its own threads).
            _pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-mask")
        return _pool


class Matchable(Protocol):
    """What a matcher reads of its grammar (structured/grammar.py's CompiledGrammar has it)."""

    @property
    def grammar(self) -> str: ...

    @property
    def lltokenizer(self) -> "llguidance.LLTokenizer": ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def eos_token_id(self) -> int: ...


class GrammarMatcher:
    def __init__(self, compiled: Matchable) -> None:
        import llguidance

        self.compiled = compiled
        self._m = llguidance.LLMatcher(compiled.lltokenizer, compiled.grammar, log_level=0)
        if self._m.is_error():  # validated at compile time, so only resource limits get here
            logger.warning("grammar matcher failed to start: %s", self._m.get_error())
        self.num_consumed = 0
        self.compute_s = 0.0  # time spent computing masks (any thread)
        self.wait_s = 0.0  # time the sampler waited for a mask
        self.num_masks = 0  # masks the sampler asked for
        self.num_late = 0  # ... of which were still being computed when asked for
        self.first_late = False  # the first one was (when the matcher is made at the first sample)
        self._pending: Future[Mask] | None = _executor().submit(self._compute)

    def _compute(self) -> Mask:  # -> [vocab_size] bool
        t0 = time.perf_counter()
        bits = np.frombuffer(self._m.compute_bitmask(), dtype=np.uint8)
        allowed: Mask = np.unpackbits(bits, bitorder="little")[: self.compiled.vocab_size].astype(bool)
        if not allowed.any():
            # An error state (or a grammar that cannot go on) allows nothing: end the output
            # rather than hand the sampler a row of -inf.
            allowed[self.compiled.eos_token_id] = True
        self.compute_s += time.perf_counter() - t0
        return allowed

    def allowed(self) -> Mask:
        """[vocab_size] bool: the tokens the grammar accepts next."""
        if self._pending is None:
            self._pending = _executor().submit(self._compute)
        late = not self._pending.done()
        if self.num_masks == 0:
            self.first_late = late
        self.num_masks += 1
        self.num_late += late
        t0 = time.perf_counter()
        mask = self._pending.result()
        self.wait_s += time.perf_counter() - t0
        return mask

    def consume(self, token: int) -> None:
        """Feed the sampled token, then start computing the next mask."""
        if self._pending is not None:
            self._pending.result()  # never touch the matcher while a mask is being computed
        if not self._m.consume_token(int(token)):
            logger.warning("grammar rejected token %d: %s", token, self._m.get_error())
        self.num_consumed += 1
        self._pending = None if self.is_done() else _executor().submit(self._compute)

    def sync(self, output_ids: Sequence[int]) -> None:
        """Bring the matcher to `output_ids` (consume what it has not seen, roll back the rest)."""
        n = len(output_ids)
        if n > self.num_consumed:
            for t in output_ids[self.num_consumed:]:
                self.consume(t)
        elif n < self.num_consumed:
            if self._pending is not None:
                self._pending.result()
            self._m.rollback(self.num_consumed - n)
            self.num_consumed = n
            self._pending = None

    def is_done(self) -> bool:
        """The grammar is complete (only EOS can follow) or broken."""
        return self._m.is_stopped() or self._m.is_error()

    def is_accepting(self) -> bool:
        return self._m.is_accepting()

    @property
    def error(self) -> str:
        return self._m.get_error()


def apply_mask(row: npt.NDArray[np.float32], allowed: Mask) -> npt.NDArray[np.float32]:
    """[V] logits, [n] bool (n <= V) -> the row with every disallowed logit at -inf (in place)."""
    n = allowed.shape[0]
    row[:n][~allowed[: row.shape[0]]] = -np.inf
    row[n:] = -np.inf  # model-padding columns past the tokenizer's vocabulary are never text
    return row
