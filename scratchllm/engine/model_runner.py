"""The model runner: turns one scheduled step into one packed forward (its logits go to sampler.py).
Numerics only; which requests run and how many tokens each is the scheduler's business.

One step = one forward over N packed tokens (every decode and every prefill chunk together), so
each weight matrix is read once per step in one GEMM of N rows: that is what makes batching pay
on a CPU, where a decode of one sequence is bound by reading the weights.
"""

import numpy as np
import numpy.typing as npt

from scratchllm.engine.paged_attention import PagedAttention
from scratchllm.engine.request import Request
from scratchllm.engine.scheduler import ScheduledBatch
from scratchllm.models.protocol import Model
from scratchllm.sampling import top_logprobs


class ModelRunner:
    def __init__(self, model: Model, num_blocks: int, block_size: int, num_threads: int = 0,
                 num_window_blocks: int | None = None, kv_dtype: str = "float32") -> None:
        self.model = model
        self.block_size = block_size
        self.attention = PagedAttention.for_model(model.config, num_blocks, block_size, num_threads,
                                                  num_window_blocks, kv_dtype)

    def execute(self, batch: ScheduledBatch) -> tuple[list[Request], npt.NDArray[np.float32]]:
        """Run the step's forward. Returns (the request of each row of logits, the logits [R, V]):
        one row for a request that gets a token, k + 1 consecutive rows for one that verifies k
        drafts (after its last token and after each draft)."""
        for group in range(self.attention.num_groups):  # copy-on-write before anything reads them
            self.attention.copy_blocks([(src, dst) for g, src, dst in batch.copies if g == group], group)
        items = batch.items
        ids: list[int] = []
        pos: list[int] = []
        lens: list[int] = []
        sample_reqs: list[Request] = []
        rows: list[int] = []
        n_total = 0
        for req, n in items:
            c = req.num_computed_tokens
            draft = batch.drafts.get(req)
            ids.extend(req.token_ids[c : c + n] if draft is None else [req.token_ids[c], *draft.tokens])
            pos.extend(range(c, c + n))
            lens.append(n)
            n_total += n
            if draft is not None:  # its last token and its drafts: every row's logits are verified
                sample_reqs.extend([req] * n)
                rows.extend(range(n_total - n, n_total))
            elif c + n == req.num_tokens:  # the step reaches the last known token: sample after it
                sample_reqs.append(req)
                rows.append(n_total - 1)
        token_seq = np.repeat(np.arange(len(items), dtype=np.int32), lens)
        positions = np.asarray(pos, dtype=np.int64)
        window_tables = self._tables([req.window_table for req, _ in items]) if self.attention.num_groups == 2 else None
        self.attention.set_layout(self._tables([req.block_table for req, _ in items]), token_seq, positions,
                                  window_tables)
        if not rows:  # only partial prefill chunks this step: K/V to fill, no token to sample
            rows = [n_total - 1]
        prompt_rows = _prompt_rows(items)  # only requests that asked for the prompt's logprobs
        # the models' forward is not annotated: it returns the float32 logits [rows, V]
        logits: npt.NDArray[np.float32] = self.model.forward(
            np.asarray(ids, dtype=np.int64), positions, self.attention,
            logits_rows=np.asarray(rows + [row for _, _, row in prompt_rows], dtype=np.int64))
        if prompt_rows:
            _add_prompt_logprobs(prompt_rows, logits[len(rows):])
        return sample_reqs, logits[: len(sample_reqs)]

    @staticmethod
    def _tables(tables: list[list[int]]) -> npt.NDArray[np.int32]:
        """The step's block tables as one array [S, longest]; padding and dropped entries (a windowed
        table's, block_pool.DROPPED) become block 0, never read."""
        out = np.zeros((len(tables), max(len(t) for t in tables)), dtype=np.int32)
        for s, table in enumerate(tables):
            out[s, : len(table)] = table
        return np.maximum(out, 0, out=out)


# --- the prompt's logprobs (SamplingParams.prompt_logprobs) -------------------------------------
def _prompt_rows(items: list[tuple[Request, int]]) -> list[tuple[Request, int, int]]:
    """(request, prompt position, packed row) of every position in this step whose logits give a
    prompt token's logprob (position p's give token p + 1's) and that no earlier step gave."""
    out: list[tuple[Request, int, int]] = []
    start = 0
    for req, n in items:
        if req.params.prompt_logprobs is not None:
            c, done = req.num_computed_tokens, len(req.prompt_logprobs)
            for p in range(max(c, done), min(c + n, req.num_prompt_tokens - 1)):
                out.append((req, p, start + p - c))
        start += n
    return out


def _add_prompt_logprobs(rows: list[tuple[Request, int, int]], logits: npt.NDArray[np.float32]) -> None:
    """Append each row's prompt token's (logprob, rank, top alternatives) to its request, in
    position order (a request's rows come in order, one step's chunk after another's)."""
    for (req, p, _), row in zip(rows, logits, strict=True):
        assert len(req.prompt_logprobs) == p, "prompt logprobs are filled in position order"
        token = req.prompt_token_ids[p + 1]
        k = req.params.prompt_logprobs
        assert k is not None
        lp, top = top_logprobs(row, token, k)
        rank = 1 + int(np.count_nonzero(row > row[token]))  # the raw logits order the same as logprobs
        req.prompt_logprobs.append((lp, rank, top))
