"""The engine contract (scratchllm/engine/protocol.py), case by case, over every implementation:
the continuous engine (AsyncEngine), the static baseline (StaticEngine), the fake engine and the
cluster's RemoteEngine (here over a stand-in for Serve's handle to the replicas that streams from
a fake engine in this process, on an event loop of its own), and the continuous engine again with
speculative decoding, by n-gram lookup and by a draft model. A case that passes for one and
fails for another is a drift the server would otherwise meet. All four have the same limits
(the tiny model's: a context of 512 tokens, a vocabulary of 97), so they accept and refuse the
same requests with the same error (engine/validate.py)."""

import asyncio
import json
import pickle
import threading
import time

import pytest

from scratchllm.cluster.remote import RemoteEngine
from scratchllm.engine import AsyncEngine, EngineClient, EngineConfig, LLMEngine
from scratchllm.engine.fake import FakeEngine
from scratchllm.engine.protocol import FINISH_REASONS, EngineStats
from scratchllm.engine.static import StaticEngine
from scratchllm.engine.validate import RequestLimits
from scratchllm.errors import ConfigError
from scratchllm.sampling import SamplingParams

from .test_async_engine import LetterTokenizer  # token t is the letter chr(97 + t % 26)
from .tiny import tiny_llama

CONTEXT, VOCAB = 512, 97  # tiny_llama's


@pytest.fixture(scope="module")
def model():
    m = tiny_llama(seed=7)
    assert (m.config.max_position_embeddings, m.config.vocab_size) == (CONTEXT, VOCAB)
    return m


class LocalReplicas:
    """Stands in for Serve's DeploymentHandle to the engine replicas, in this process:
    `generate.remote(ids, params, request_id, avoid)` streams the replica's id, then the
    request's events from a local engine, as EngineReplica.generate does; `cancel()` on the
    response aborts the request there."""

    def __init__(self, engine):
        self.engine = engine
        self.generate = self

    def options(self, stream=False):
        return self

    def remote(self, ids, params, request_id, avoid=()):
        return LocalResponse(self.engine, ids, params, request_id)


class LocalResponse:
    def __init__(self, engine, ids, params, request_id):
        self.engine, self.args, self.stream = engine, (ids, params, request_id), None

    def __aiter__(self):
        return self._events()

    async def _events(self):
        ids, params, rid = self.args
        self.stream = self.engine.submit(ids, params, request_id=rid)
        yield "local-replica"
        async for event in self.stream:
            yield event

    def cancel(self):
        if self.stream is not None:
            self.stream.abort()


@pytest.fixture(scope="module")
def loop():
    """An event loop on a thread of its own: the ingress's, where RemoteEngine's requests run."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join()
    loop.close()


ENGINES = ["continuous", "static", "fake", "remote", "ngram", "draft"]
# The continuous engine with speculative decoding, drafting on every step it can (adaptive off):
# n-gram lookup from one token on (its drafts mostly rejected on these random prompts), and a
# draft model that is the target itself (its drafts all accepted: several tokens a step).
SPECULATIVE = {"ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
                         "prompt_lookup_max": 3, "adaptive": False},
               "draft": {"model": "the target's twin", "num_speculative_tokens": 3, "adaptive": False}}


def speculative_engine(kind, model, tokenizer):
    config = EngineConfig(num_kv_blocks=256, speculative_config=SPECULATIVE[kind])
    return AsyncEngine(LLMEngine(model, config, tokenizer=tokenizer, draft_model=model if kind == "draft" else None))


def make_engine(kind, model, loop):
    if kind in SPECULATIVE:
        return speculative_engine(kind, model, LetterTokenizer())
    if kind == "continuous":
        return AsyncEngine(LLMEngine(model, EngineConfig(num_kv_blocks=256), tokenizer=LetterTokenizer()))
    if kind == "static":
        return StaticEngine(model, LetterTokenizer(), batch_size=4)
    if kind == "fake":
        return FakeEngine(step_ms=0.5, max_running=4, max_model_len=CONTEXT, vocab_size=VOCAB)
    replica = FakeEngine(step_ms=0.5, max_running=4, max_model_len=CONTEXT, vocab_size=VOCAB)
    return RemoteEngine(LocalReplicas(replica), RequestLimits(CONTEXT, VOCAB), loop=loop)


@pytest.fixture(params=ENGINES)
def engine(request, model, loop):
    e = make_engine(request.param, model, loop)
    yield e
    e.shutdown(drain=False)
    if isinstance(e, RemoteEngine):
        e.handle.engine.shutdown(drain=False)


def blocks_used(engine):
    """KV blocks in use where they are held: a RemoteEngine's are its replica's."""
    if isinstance(engine, RemoteEngine):
        engine = engine.handle.engine
    return engine.stats().kv_blocks_used


PROMPT = [5, 9, 14, 3, 7]


def greedy(n, **kw):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


def check_order(events, request_id=None):
    """The contract's event order: indexes 0..n-1, one finish_reason, on the last event, with metrics."""
    assert [e.index for e in events if e.token_id is not None] == list(range(sum(e.token_id is not None
                                                                                for e in events)))
    assert [e.finish_reason is not None for e in events] == [False] * (len(events) - 1) + [True]
    assert events[-1].finish_reason in FINISH_REASONS and events[-1].metrics is not None
    if request_id is not None:
        assert {e.request_id for e in events} == {request_id}


def wait_until(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def test_is_an_engine_client(engine):
    assert isinstance(engine, EngineClient)


def test_length_finish_and_event_order(engine):
    events = list(engine.submit(PROMPT, greedy(7), request_id="mine"))
    check_order(events, "mine")
    assert len(events) == 7 and events[-1].finish_reason == "length"
    m = events[-1].metrics
    assert m.prompt_tokens == len(PROMPT) and m.completion_tokens == 7
    assert m.arrival <= m.first_scheduled <= m.first_token <= m.finished
    assert min(m.queue_ms, m.prefill_ms, m.decode_ms) >= 0


def test_thread_and_event_loop_readers_see_the_same_events(engine):
    sync = [(e.token_id, e.text) for e in engine.submit(PROMPT, greedy(6))]

    async def read():
        return [(e.token_id, e.text) async for e in engine.submit(PROMPT, greedy(6))]

    assert asyncio.run(read()) == sync


def test_many_streams_on_one_loop(engine):
    async def one(i):
        return [e async for e in engine.submit(PROMPT + [i], greedy(3 + i % 4))]

    async def main():
        return await asyncio.gather(*(one(i) for i in range(12)))

    for i, events in enumerate(asyncio.run(main())):
        check_order(events)
        assert len(events) == 3 + i % 4


def test_text_deltas_join_and_stop_strings_cut(engine):
    full = "".join(e.text for e in engine.submit(PROMPT, greedy(16)))
    assert len(full) >= 10
    stop = full[6:8]
    cut = full.find(stop)
    events = list(engine.submit(PROMPT, greedy(16, stop=(stop,))))
    check_order(events)
    assert "".join(e.text for e in events) == full[:cut] and events[-1].finish_reason == "stop"


def test_abort_mid_stream_ends_the_stream_and_frees_its_blocks(engine):
    stream = engine.submit(PROMPT, greedy(500))
    events = []
    for e in stream:
        events.append(e)
        if len(events) == 2:
            stream.abort()
    check_order(events)
    assert events[-1].finish_reason == "abort" and len(events) < 500
    wait_until(lambda: blocks_used(engine) == 0)
    assert engine.stats().finished["abort"] >= 1


def test_abort_by_id_before_it_runs(engine):
    streams = [engine.submit(PROMPT + [i], greedy(200)) for i in range(6)]
    for s in streams:
        engine.abort(s.request_id)
    for s in streams:
        events = list(s)
        check_order(events)
        assert events[-1].finish_reason == "abort"
    wait_until(lambda: blocks_used(engine) == 0)


def test_shutdown_without_drain_aborts_and_refuses_new_work(engine):
    streams = [engine.submit(PROMPT + [i], greedy(300)) for i in range(3)]
    engine.shutdown(drain=False)
    assert [list(s)[-1].finish_reason for s in streams] == ["abort"] * 3
    with pytest.raises(RuntimeError):
        engine.submit(PROMPT, greedy(2))


# (prompt, params, the ConfigError's message): every engine refuses these at submit, alike
REFUSED = {
    "empty prompt": ([], greedy(2), "the prompt is empty: it has no tokens to continue from"),
    "id at the vocabulary's end": ([5, VOCAB], greedy(2), f"prompt token ids must be integers in [0, {VOCAB})"),
    "negative id": ([-1, 5], greedy(2), f"prompt token ids must be integers in [0, {VOCAB})"),
    "id not an integer": ([5, 2.0], greedy(2), f"prompt token ids must be integers in [0, {VOCAB})"),
    "prompt at the context": ([3] * CONTEXT, greedy(1),
                              f"the prompt has {CONTEXT} tokens; this engine's context is {CONTEXT} "
                              "(at least one must be left to generate)"),
    "prompt over the context": ([3] * (CONTEXT + 5), greedy(1),
                                f"the prompt has {CONTEXT + 5} tokens; this engine's context is {CONTEXT} "
                                "(at least one must be left to generate)"),
    "params not SamplingParams": (PROMPT, {"max_tokens": 2}, "params must be SamplingParams, got dict"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_bad_input_is_refused_at_submit_with_the_same_error(engine, case):
    prompt, params, message = REFUSED[case]
    with pytest.raises(ConfigError) as err:
        engine.submit(prompt, params)
    assert str(err.value) == message
    assert engine.stats().running == 0 and engine.stats().waiting == 0  # nothing was queued


# (prompt length, max_tokens, tokens made): accepted by every engine; a request whose prompt +
# max_tokens is over the context ends with "length" when the context is full
ACCEPTED = {
    "largest id": ([VOCAB - 1] * 4, 5, 5),
    "one token of room": ([3] * (CONTEXT - 1), 1, 1),
    "max_tokens past the context": ([3] * (CONTEXT - 12), 100, 12),
}


@pytest.mark.parametrize("case", list(ACCEPTED))
def test_requests_at_the_limits_are_accepted_alike(engine, case):
    prompt, max_tokens, made = ACCEPTED[case]
    events = list(engine.submit(prompt, greedy(max_tokens)))
    check_order(events)
    assert len(events) == made and events[-1].finish_reason == "length"
    assert events[-1].metrics.prompt_tokens == len(prompt)


def test_stats_are_one_typed_value_that_crosses_processes(engine):
    list(engine.submit(PROMPT, greedy(3)))
    stats = engine.stats()
    assert isinstance(stats, EngineStats) and stats.running == 0 and stats.waiting == 0
    assert stats.finished["length"] >= 1 and set(stats.finished) == set(FINISH_REASONS)
    assert pickle.loads(pickle.dumps(stats)) == stats  # a cluster's replicas send it across Ray
    holds_blocks = not isinstance(engine, RemoteEngine)  # RemoteEngine's replicas hold them
    for figure in (stats.kv_blocks_used, stats.kv_blocks_peak, stats.kv_block_bytes, stats.preemptions):
        assert (figure is not None) == holds_blocks
    if holds_blocks:
        assert stats.kv_blocks_used == 0 and stats.kv_blocks_peak >= 1 and stats.kv_block_bytes > 0


def test_request_ids_are_kept_or_allocated_never_shared(engine):
    mine = engine.submit(PROMPT, greedy(400), request_id="same")
    again = engine.submit(PROMPT, greedy(2), request_id="same")  # "same" is open: the second gets another id
    others = [engine.submit(PROMPT, greedy(2)) for _ in range(3)]
    ids = [s.request_id for s in (mine, again, *others)]
    assert ids[0] == "same" and len(set(ids)) == 5
    mine.abort()
    check_order(list(mine), "same")
    for s in (again, *others):
        check_order(list(s), s.request_id)
    assert engine.stats().finished["abort"] == 1 and engine.stats().finished["length"] == 4


def test_a_group_of_requests_on_one_prompt(engine):
    streams = engine.submit_group(PROMPT, [greedy(5), greedy(5), greedy(3)], ["g0", "g1", "g2"])
    events = {s.request_id: list(s) for s in streams}
    for rid, evs in events.items():
        check_order(evs, rid)
    assert [e.token_id for e in events["g0"]] == [e.token_id for e in events["g1"]]
    assert [e.token_id for e in events["g2"]] == [e.token_id for e in events["g0"]][:3]
    wait_until(lambda: blocks_used(engine) == 0)


# ---- the sampling path (engine/sampler.py): every engine shapes and draws a row alike ----------
def tokens(events):
    return [e.token_id for e in events if e.token_id is not None]


def run(engine, params, prompt=PROMPT):
    events = list(engine.submit(prompt, params))
    check_order(events)
    return events


def test_logit_bias_bans_and_forces_tokens(engine):
    plain = tokens(run(engine, greedy(8)))
    banned = tokens(run(engine, greedy(8, logit_bias={t: -100 for t in plain})))
    assert len(banned) == 8 and not set(banned) & set(plain)
    other = min(set(range(VOCAB)) - set(plain))
    assert tokens(run(engine, greedy(8, logit_bias={other: 100}))) == [other] * 8


def full_logprobs(event):
    """The raw logprob of every token the event lists (all of them, with logprobs=VOCAB)."""
    return dict(event.top_logprobs)


@pytest.mark.parametrize("penalty", [{"frequency_penalty": 2.0}, {"presence_penalty": 2.0, "frequency_penalty": 2.0}])
def test_presence_and_frequency_penalties_shape_every_draw(engine, penalty):
    """Each greedy token is the argmax of the model's own logprobs (reported in full) less OpenAI's
    penalties over the tokens before it; and the penalties change what a plain run writes."""
    events = run(engine, greedy(64, logprobs=VOCAB, **penalty))
    out = []
    for e in events:
        counts = {t: out.count(t) for t in set(out)}
        shaped = {t: lp - counts.get(t, 0) * penalty.get("frequency_penalty", 0.0)
                  - (t in counts) * penalty.get("presence_penalty", 0.0) for t, lp in full_logprobs(e).items()}
        assert shaped[e.token_id] >= max(shaped.values()) - 1e-4, (len(out), e.token_id)
        out.append(e.token_id)
    assert out != tokens(run(engine, greedy(64))), "the penalty must change this output, or the test shows nothing"


def test_repetition_penalty_keeps_seen_tokens_out(engine):
    """At the largest repetition penalty a token of the prompt or of the output so far loses to
    the unseen ones (this model's and the fake's rows have unseen tokens with positive logits)."""
    out = tokens(run(engine, greedy(24, repetition_penalty=100.0)))
    seen = set(PROMPT)
    for t in out:
        assert t not in seen, (t, out)
        seen.add(t)
    assert out != tokens(run(engine, greedy(24)))


def test_min_tokens_holds_back_the_end_tokens(engine):
    first = tokens(run(engine, greedy(8)))[0]
    stop_at_once = run(engine, SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=(first,)))
    assert tokens(stop_at_once) == [first] and stop_at_once[-1].finish_reason == "stop"
    held = tokens(run(engine, SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=(first,), min_tokens=5)))
    assert len(held) >= 5 and first not in held[:5]


def test_stop_token_ids_end_the_request_and_show_no_text(engine):
    plain = run(engine, greedy(12))
    ids = tokens(plain)
    end = ids[4]
    cut = ids.index(end)
    events = run(engine, greedy(12, stop_token_ids=(end,)))  # ignore_eos does not turn stop tokens off
    assert tokens(events) == ids[: cut + 1] and events[-1].finish_reason == "stop"
    assert events[-1].text == "" and "".join(e.text for e in plain).startswith("".join(e.text for e in events))


# Grammars need a tokenizer whose tokens are bytes: every engine here runs on the fake's byte
# vocabulary (id = byte + 3, EOS 2), the model on a vocabulary of that size.
@pytest.fixture(params=ENGINES)
def byte_engine(request, loop):
    from scratchllm.engine.fake import BYTE_TOKENS, FakeTokenizer

    kind = request.param
    if kind in ("continuous", "static", *SPECULATIVE):
        model = tiny_llama(seed=7, vocab=BYTE_TOKENS)
        tok = FakeTokenizer(BYTE_TOKENS)
        if kind in SPECULATIVE:
            e = speculative_engine(kind, model, tok)
        elif kind == "continuous":
            e = AsyncEngine(LLMEngine(model, EngineConfig(num_kv_blocks=256), tokenizer=tok))
        else:
            e = StaticEngine(model, tok, batch_size=4)
    elif kind == "fake":
        e = FakeEngine(step_ms=0.5, max_running=4, max_model_len=CONTEXT, vocab_size=BYTE_TOKENS)
    else:
        replica = FakeEngine(step_ms=0.5, max_running=4, max_model_len=CONTEXT, vocab_size=BYTE_TOKENS)
        e = RemoteEngine(LocalReplicas(replica), RequestLimits(CONTEXT, BYTE_TOKENS), loop=loop)
    yield e
    e.shutdown(drain=False)
    if isinstance(e, RemoteEngine):
        e.handle.engine.shutdown(drain=False)


@pytest.fixture(scope="module")
def compiler():
    from scratchllm.engine.fake import BYTE_TOKENS, FakeTokenizer
    from scratchllm.structured import GrammarCompiler

    return GrammarCompiler(FakeTokenizer(BYTE_TOKENS))


def byte_text(ids):
    from scratchllm.engine.fake import FakeTokenizer

    return FakeTokenizer().decode(ids)


SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "size": {"enum": ["S", "M", "L"]}},
          "required": ["ok", "size"], "additionalProperties": False}


def test_json_schema_output_validates(byte_engine, compiler):
    import jsonschema

    events = run(byte_engine, SamplingParams(max_tokens=40, temperature=0.0, grammar=compiler.json_schema(SCHEMA)),
                 prompt=[40, 50, 60, 70])
    assert events[-1].finish_reason == "stop" and events[-1].token_id == 2  # the grammar ended it with EOS
    jsonschema.validate(json.loads(byte_text(tokens(events))), SCHEMA)


def test_json_object_output_is_a_json_object_so_far(byte_engine, compiler):
    """Every token the engine drew is one the grammar allowed there (a fresh matcher replays
    them); an output that ended is one whole JSON object."""
    grammar = compiler.json_object()
    for seed in range(3):
        events = run(byte_engine, SamplingParams(max_tokens=24, temperature=1.0, seed=seed, grammar=grammar),
                     prompt=[40 + seed, 50, 60])
        replay = grammar.new_matcher()
        for t in tokens(events):
            assert replay.allowed()[t], (seed, byte_text(tokens(events)))
            replay.consume(t)
        if events[-1].finish_reason == "stop":
            assert isinstance(json.loads(byte_text(tokens(events)[:-1])), dict)
