"""POST /v1/completions, plain and streamed (SSE): n choices per prompt, best_of, echo, logprobs,
the prompt's logprobs, and `suffix` (fill-in-the-middle, fill.py).

best_of: best_of choices are generated per prompt (on the prompt's forked KV blocks) and the n
with the highest mean logprob per generated token are returned, best first (OpenAI's "highest
log probability per token"). echo: the prompt's text comes before the completion's, and
`logprobs.text_offset` counts characters of that returned text. echo with logprobs: `logprobs`
starts with the prompt's tokens (the first has a null logprob: nothing comes before it), as
OpenAI's legacy API and lm-evaluation-harness's loglikelihood requests read them; max_tokens 0
(with echo) returns the prompt alone. `prompt_logprobs` (vLLM's): the choice's
`prompt_logprobs`, [null, {token id: {"logprob", "rank", "decoded_token"}}, ...] with the
prompt token and its top alternatives. The engine computes them during the prefill
(SamplingParams.prompt_logprobs), for requests that ask only.
"""

import dataclasses
from collections.abc import AsyncGenerator
from typing import Any, cast

from fastapi import Request
from fastapi.responses import Response

from scratchllm.engine.protocol import PromptLogprob, RequestMetrics, RequestOutput
from scratchllm.sampling import SamplingParams
from scratchllm.server.fill import ending_middle, fim_layout, fim_prompt_ids
from scratchllm.server.generation import (
    EventStream,
    Generation,
    LogprobItem,
    choice_params,
    event_logprob,
    max_tokens_for,
    origin_of,
    prompt_ids,
    read_request,
    sampling_params,
    token_logprobs,
    token_str,
    usage_of,
)
from scratchllm.server.protocol import CompletionRequest, bad_request, new_id, now_s
from scratchllm.server.sse import SSE_DONE
from scratchllm.server.state import ServerState
from scratchllm.server.timings import reply_timings
from scratchllm.tokenizer.fim import FimLayout
from scratchllm.tokenizer.protocol import TokenizerLike

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


async def completions(request: Request) -> Response | dict[str, Any]:
    state, raw, req = await read_request(request, CompletionRequest)
    texts = req.prompts()
    layout = fim_layout(state, "suffix") if req.suffix else None
    prompts = [prompt_ids(state, p, "prompt") if layout is None else _fim_ids(state, layout, p, req.suffix or "")
               for p in texts]
    if req.stream and len(prompts) > 1:
        raise bad_request("streaming takes one prompt per request", param="prompt")
    n = req.n
    best_of = req.best_of or n
    nothing = req.max_tokens == 0  # echo only: one token is generated (the prefill makes it) and dropped
    params: list[list[SamplingParams]] = []
    for ids in prompts:
        p = await sampling_params(state, req, max_tokens_for(state, len(ids), 1 if nothing else req.max_tokens,
                                                              COMPLETIONS_DEFAULT_MAX_TOKENS, "prompt"))
        if best_of > n and p.logprobs is None:  # the ranking needs each token's logprob
            p = dataclasses.replace(p, logprobs=0)
        if layout is not None:
            p = ending_middle(p, layout)
        params.append(choice_params(p, best_of))
    rid, created = new_id("cmpl"), now_s()
    gen = Generation(state, prompts, params, rid, origin_of(state, request, raw, "/v1/completions"))
    head = {"id": rid, "object": "text_completion", "created": created, "model": req.model}
    tok = state.model.tokenizer
    echoed = [(t if isinstance(t, str) else tok.decode(ids)) if req.echo else "" for t, ids in zip(texts, prompts,
                                                                                                  strict=True)]
    if req.stream:
        return EventStream(_stream(gen, head, req, tok, echoed[0]), gen)
    results = await gen.collect(request.receive)
    if results is None:
        return Response(status_code=499)  # the client is gone; nobody reads this
    if nothing:
        results = [dataclasses.replace(r, token_ids=[], text="", finish_reason="length",
                                       logprobs=[] if r.logprobs is not None else None) for r in results]
    choices = []
    for q in range(len(prompts)):
        for j, r in enumerate(_best(results[q * best_of:(q + 1) * best_of], n)):
            text = echoed[q] + r.text
            choice = {"index": q * n + j, "text": text, "finish_reason": r.finish_reason, "logprobs": None}
            if req.logprobs is not None:
                items = _prompt_items(prompts[q], r.prompt_logprobs) if req.echo_logprobs else []
                items += token_logprobs(r)
                offsets = TextOffsets(tok, 0 if req.echo_logprobs else len(echoed[q])).of(items)
                choice["logprobs"] = _logprobs(tok, items, offsets, len(text))
            if req.prompt_logprobs is not None:
                choice["prompt_logprobs"] = _vllm_prompt_logprobs(tok, prompts[q], r.prompt_logprobs)
            choices.append(choice)
    n_out = sum(len(r.token_ids) for r in results)  # best_of: every generated token is billed, as OpenAI does
    return gen.reply({**head, "choices": choices, "usage": usage_of(gen, n_out, [r.metrics for r in results]),
                      "timings": reply_timings(results[0], req.timings_per_token)})


def _fim_ids(state: ServerState, layout: FimLayout, prompt: str | list[int], suffix: str) -> list[int]:
    """A fill-in-the-middle prompt: the prompt's text before the insertion point, `suffix` after."""
    if not isinstance(prompt, str):
        raise bad_request("'suffix' needs the prompt as text: the layout tokenizes the text around the insertion "
                          "point", param="prompt")
    return fim_prompt_ids(state, layout, prompt, suffix)


def _prompt_items(ids: list[int], entries: list[PromptLogprob] | None) -> list[LogprobItem]:
    """The prompt's tokens as logprob items: the first without one, then the engine's entries."""
    assert entries is not None and len(entries) == len(ids) - 1, "one per prompt token but the first"
    return [(ids[0], None, None)] + [(t, lp, top) for t, (lp, _, top) in zip(ids[1:], entries, strict=True)]


def _vllm_prompt_logprobs(tok: TokenizerLike, ids: list[int], entries: list[PromptLogprob] | None
                          ) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's prompt_logprobs: per prompt token, {token id: {"logprob", "rank", "decoded_token"}} of
    the token itself and its top alternatives (the first token: null)."""
    assert entries is not None and len(entries) == len(ids) - 1
    out: list[dict[str, dict[str, Any]] | None] = [None]
    for t, (lp, rank, top) in zip(ids[1:], entries, strict=True):
        entry = {str(i): {"logprob": v, "rank": r, "decoded_token": token_str(tok, i)}
                 for r, (i, v) in enumerate(top, start=1)}
        entry[str(t)] = {"logprob": lp, "rank": rank, "decoded_token": token_str(tok, t)}
        out.append(entry)
    return out


def mean_logprob(r: RequestOutput) -> float:
    """The ranking score of a choice: its mean logprob per generated token (-inf without one)."""
    lps = [lp for lp, _ in r.logprobs or [] if lp is not None]
    return sum(lps) / len(lps) if lps else float("-inf")


def _best(results: list[RequestOutput], n: int) -> list[RequestOutput]:
    """The n best of one prompt's choices (all of them, in order, when there are only n)."""
    if len(results) == n:
        return results
    order = sorted(range(len(results)), key=lambda i: (-mean_logprob(results[i]), i))  # ties: the earlier choice
    return [results[i] for i in order[:n]]


class TextOffsets:
    """Where each token's text starts in a choice's returned text, token after token: from
    `start` (after the echoed prompt), on by the token's text as it detokenizes (an end token
    shows none). One per choice, so a stream's chunks count on from the chunks before."""

    def __init__(self, tok: TokenizerLike, start: int) -> None:
        self.detok, self.at = tok.detokenizer(skip_special_tokens=True), start

    def of(self, items: list[LogprobItem]) -> list[int]:
        out = []
        for t, _, _ in items:
            out.append(self.at)
            self.at += len(self.detok.push(t)) if t is not None else 0
        return out


def _logprobs(tok: TokenizerLike, items: list[LogprobItem], offsets: list[int], end: int | None) -> dict[str, Any]:
    """OpenAI's completions logprobs; text_offset[i] is where token i's text starts in the
    returned text, never past its `end` (None: a stream's end, not known yet)."""
    return {"tokens": [token_str(tok, t) for t, _, _ in items], "token_logprobs": [lp for _, lp, _ in items],
            "top_logprobs": [None if top is None else {token_str(tok, i): lp for i, lp in top} for _, _, top in items],
            "text_offset": offsets if end is None else [min(at, end) for at in offsets]}


async def _stream(gen: Generation, head: dict[str, Any], req: CompletionRequest, tok: TokenizerLike,
                  echoed: str) -> AsyncGenerator[bytes, None]:
    count = len(gen.streams)
    n_out, metrics = 0, cast(list[RequestMetrics | None], [None] * count)
    sent = [len(echoed)] * count  # characters of each choice's returned text so far
    offsets = [TextOffsets(tok, 0 if req.echo_logprobs else len(echoed)) for _ in range(count)]
    # the echo goes first; with the prompt's logprobs it waits for them (the first event brings them)
    late_echo = req.echo_logprobs or req.prompt_logprobs is not None
    if echoed and not late_echo:
        for k in range(count):
            yield gen.chunks.encode({**head, "choices": [{"index": k, "text": echoed, "finish_reason": None,
                                                          "logprobs": None}]})
    async for k, event in gen.merged():
        if late_echo and event.index == 0 and event.finish_reason != "abort":
            yield gen.chunks.encode({**head, "choices": [_echo_choice(k, req, tok, gen.prompt_of(k), echoed,
                                                                      event.prompt_logprobs, offsets[k])]})
        n_out += event.finish_reason != "abort"
        per_token = gen.token_timings(k, event) if req.timings_per_token else None
        item = event_logprob(gen, k, event)
        # per-token times or logprobs: a chunk per token, with no text while the token shows none
        if event.text or event.finish_reason or per_token is not None or item is not None:
            choice: dict[str, Any] = {"index": k, "text": event.text, "finish_reason": event.finish_reason,
                                      "logprobs": None}
            sent[k] += len(event.text)
            if item is not None:  # the returned text's end is known at its last chunk
                end = sent[k] if event.finish_reason else None
                choice["logprobs"] = _logprobs(tok, [item], offsets[k].of([item]), end)
            chunk = {**head, "choices": [choice]}
            if event.finish_reason:
                chunk["timings"] = gen.final_timings(event.metrics, per_token)
                metrics[k] = event.metrics
            elif per_token is not None:
                chunk["timings"] = per_token
            yield gen.chunks.encode(chunk)
    if req.stream_options and req.stream_options.include_usage:
        yield gen.chunks.encode({**head, "choices": [], "usage": usage_of(gen, n_out, metrics)})
    yield SSE_DONE


def _echo_choice(k: int, req: CompletionRequest, tok: TokenizerLike, ids: list[int], echoed: str,
                 entries: list[PromptLogprob] | None, offsets: TextOffsets) -> dict[str, Any]:
    """A stream's first chunk when the prompt's logprobs were asked for: the echoed text (if
    echo), its logprobs (echo with logprobs) and vLLM's prompt_logprobs."""
    choice: dict[str, Any] = {"index": k, "text": echoed, "finish_reason": None, "logprobs": None}
    if req.echo_logprobs:
        items = _prompt_items(ids, entries)
        choice["logprobs"] = _logprobs(tok, items, offsets.of(items), len(echoed))
    if req.prompt_logprobs is not None:
        choice["prompt_logprobs"] = _vllm_prompt_logprobs(tok, ids, entries)
    return choice
