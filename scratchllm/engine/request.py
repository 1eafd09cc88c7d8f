"""A request and its state machine, with the monotonic timestamps the metrics are made of.

    WAITING --admit--> RUNNING --eos/stop/length--> FINISHED
       ^                  |
       |              preempt (blocks freed, recompute later)
       +---- PREEMPTED <--+
    abort: from any live state to ABORTED.

Tokens: `token_ids` = prompt + output so far. `num_computed_tokens` of them have their K/V in the
paged cache. Invariant: 0 <= num_computed_tokens <= len(token_ids), and the block table covers
at least num_computed_tokens slots. Preemption by recompute resets num_computed_tokens to 0 and
keeps token_ids, so a resumed request re-prefills prompt + output and continues unchanged.
"""

import enum
import time
from dataclasses import dataclass, field

import numpy as np

from scratchllm.engine.protocol import PromptLogprob, RequestMetrics
from scratchllm.sampling import SamplingParams, make_rng


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"
    ABORTED = "aborted"

    @property
    def done(self) -> bool:
        return self in (RequestStatus.FINISHED, RequestStatus.ABORTED)


class Priority(enum.IntEnum):
    HIGH = 0  # the priority policy's short requests (max_tokens < 256), FIFO
    LOW = 1  # everything else, by arrival


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: Priority | None  # None: the admission policy classifies it when it is queued
    arrival: float = field(default_factory=time.monotonic)
    seq_no: int = 0  # the scheduler's tie-break: among equal times, first added goes first
    priority_adjust_s: float = 0.0  # from the priority hook: > 0 ages faster, < 0 slower
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of the cached full blocks
    window_table: list[int] = field(default_factory=list)  # the windowed layers' blocks (block_manager.py)
    finish_reason: str | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens whose K/V the prefix cache held at first admission
    # speculative decoding: tokens drafted for this request and verified, and those accepted
    spec_drafted: int = 0
    spec_accepted: int = 0
    # n > 1 sampling: the other choices of this prompt wait here until this request's prefill is
    # done, then fork its KV blocks (block_manager.fork) and sample from the same logits
    fork_children: list["Request"] = field(default_factory=list)
    fork_parent: "Request | None" = None
    # params.prompt_logprobs: entry i is prompt token i + 1's, filled chunk by chunk during the
    # prefill (model_runner); a recompute after preemption does not add them again
    prompt_logprobs: list[PromptLogprob] = field(default_factory=list)
    # timestamps (monotonic)
    first_scheduled: float | None = None
    first_token: float | None = None
    token_times: list[float] = field(default_factory=list)
    finished: float | None = None

    def __post_init__(self) -> None:
        assert len(self.prompt_token_ids) >= 1, "a request needs at least one prompt token"
        self.prompt_token_ids = [int(t) for t in self.prompt_token_ids]
        self.token_ids: list[int] = list(self.prompt_token_ids)
        self.rng: np.random.Generator = make_rng(self.params)

    # --- sizes ---
    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    # --- transitions ---
    def append_token(self, token_id: int, now: float) -> None:
        self.token_ids.append(int(token_id))
        if self.first_token is None:
            self.first_token = now
        self.token_times.append(now)

    def finish(self, reason: str, now: float) -> None:
        assert not self.status.done, f"request {self.request_id} finished twice"
        self.status = RequestStatus.ABORTED if reason == "abort" else RequestStatus.FINISHED
        self.finish_reason = reason
        self.finished = now

    def metrics(self) -> RequestMetrics:
        return RequestMetrics(
            arrival=self.arrival,
            first_scheduled=self.first_scheduled,
            first_token=self.first_token,
            finished=self.finished,
            prompt_tokens=self.num_prompt_tokens,
            completion_tokens=self.num_output_tokens,
            num_preemptions=self.num_preemptions,
            cached_tokens=self.num_cached_tokens,
            spec_drafted=self.spec_drafted,
            spec_accepted=self.spec_accepted,
        )
