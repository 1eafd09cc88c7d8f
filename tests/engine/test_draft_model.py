"""The draft model's runner: its proposals are the draft model's own greedy continuation, its
cache follows a request whose drafts were rejected exactly as a fresh cache would, and its blocks
go back when the request leaves."""

import numpy as np

from scratchllm.engine.request import Request
from scratchllm.engine.speculative.draft_model import DraftModel
from scratchllm.sampling import SamplingParams
from tests.engine.tiny import greedy_alone, tiny_llama


def request(tokens, rid="r", **params):
    return Request(rid, list(tokens), SamplingParams(max_tokens=64, temperature=params.pop("temperature", 0.0),
                                                     **params), None)


def test_greedy_proposals_are_the_drafts_own_greedy_tokens():
    model = tiny_llama(seed=3)
    runner = DraftModel(model, num_blocks=32, block_size=4)
    prompt = [5, 17, 3, 44, 9, 12, 70]
    req = request(prompt)
    want = greedy_alone(model, prompt, 12)
    got = runner.propose([req], [5])[0]
    assert got.tokens == want[:5] and got.probs is None
    # the target accepted 2 of them and emitted its own third token (not the draft's)
    req.token_ids += want[:2] + [(want[2] + 1) % 97]
    again = runner.propose([req], [4])[0]
    fresh = DraftModel(model, num_blocks=32, block_size=4).propose([request(req.token_ids, "s")], [4])[0]
    assert again.tokens == fresh.tokens == greedy_alone(model, req.token_ids, 4)


def test_a_batch_of_requests_with_their_own_lengths():
    model = tiny_llama(seed=4)
    runner = DraftModel(model, num_blocks=64, block_size=4)
    prompts = [[1, 2, 3], [40, 41, 42, 43, 44, 45, 46, 47, 48], [7]]
    reqs = [request(p, f"r{i}") for i, p in enumerate(prompts)]
    got = runner.propose(reqs, [3, 0, 5])
    assert [d.tokens for d in got] == [greedy_alone(model, prompts[0], 3), [], greedy_alone(model, prompts[2], 5)]
    used = runner.num_used_blocks
    assert used > 0
    for r in reqs:
        runner.release(r.request_id)
    assert runner.num_used_blocks == 0


def test_p_min_stops_an_unsure_draft_and_sampled_drafts_keep_q():
    model = tiny_llama(seed=5)
    sure = DraftModel(model, num_blocks=32, block_size=4, p_min=1.0)  # nothing is that sure
    assert sure.propose([request([1, 2, 3])], [4])[0].tokens == []
    runner = DraftModel(model, num_blocks=32, block_size=4)
    d = runner.propose([request([1, 2, 3], temperature=0.8, top_k=5, seed=1)], [3])[0]
    assert len(d.tokens) == 3 and d.probs is not None and len(d.probs) == 3
    for token, q in zip(d.tokens, d.probs, strict=True):
        assert q[token] > 0 and np.count_nonzero(q) <= 5 and abs(float(q.sum()) - 1) < 1e-5


def test_a_full_pool_drafts_nothing():
    runner = DraftModel(tiny_llama(seed=6), num_blocks=2, block_size=4)
    assert runner.propose([request(range(1, 12))], [3])[0].tokens == []
    assert runner.num_used_blocks == 0


def test_a_draft_positions_cost_is_timed_on_regular_proposals_only(monkeypatch):
    """draft_s, the draft-length rule's cost of one draft position, is a proposal's whole time
    over its forwards when each request catches up by at most the two tokens a verification
    emits; a proposal that feeds a prompt (a prefill) leaves it as it was."""
    from types import SimpleNamespace

    import scratchllm.engine.speculative.draft_model as dm

    clock = iter(float(t) for t in range(0, 1000, 6))  # each reading of the draft's clock: 6 s later
    monkeypatch.setattr(dm, "time", SimpleNamespace(perf_counter=lambda: next(clock)))
    runner = DraftModel(tiny_llama(seed=7), num_blocks=32, block_size=4)
    req = request([1, 2, 3, 4, 5, 6])
    d = runner.propose([req], [3])[0]
    assert len(d.tokens) == 3 and runner.draft_s is None  # the prompt's catch-up: not timed
    req.token_ids += d.tokens + [9]  # all three accepted, and the target's own token: catch-up of 2
    runner.propose([req], [2])
    assert runner.draft_s == 6 / 2  # one 6 s proposal, two forwards
