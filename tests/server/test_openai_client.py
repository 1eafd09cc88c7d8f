"""The official `openai` client against a live server over the fake engine (loopback, ephemeral port).

The fake is deterministic, so each answer is checked against what the fake itself produces
for the same token ids (its tokenizer and phrase), not against literals.
"""

import base64

import numpy as np
import openai
import pytest

from scratchllm.engine.fake import PHRASE, FakeTokenizer
from scratchllm.server.backend import fake_embed
from scratchllm.tokenizer.tokenizer import pad_batch

TOK = FakeTokenizer()


def expected_greedy(prompt_ids: list[int], n: int) -> str:
    """The fake's greedy continuation: the phrase entered at the first character boundary at or
    after sum(prompt) mod its length. A character cut by max_tokens shows as U+FFFD, as the real
    engine's output path (and decode) shows it."""
    start = sum(prompt_ids) % len(PHRASE)
    while PHRASE[start] & 0xC0 == 0x80:
        start = (start + 1) % len(PHRASE)
    raw = bytes(PHRASE[(start + i) % len(PHRASE)] for i in range(n))
    return raw.decode("utf-8", errors="replace")


@pytest.fixture(scope="module")
def client(fake_server):
    url, _ = fake_server
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=20)


def chat_ids(messages):
    return TOK.encode(TOK.apply_chat_template(messages))


def test_models_lists_generation_and_embedding_models(client):
    ids = [m.id for m in client.models.list().data]
    assert ids == ["fake", "fake-embed"]


def test_completion_greedy_matches_engine_output(client):
    r = client.completions.create(model="fake", prompt="Hello there", max_tokens=24, temperature=0)
    prompt_ids = TOK.encode("Hello there")
    assert r.choices[0].text == expected_greedy(prompt_ids, 24)
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(prompt_ids), 24)
    t = r.model_extra["timings"]
    assert t["completion_tokens"] == 24 and t["prompt_tokens"] == len(prompt_ids)
    assert t["queue_ms"] >= 0 and t["prefill_ms"] >= 0 and t["decode_ms"] > 0 and t["decode_tokens_per_s"] > 0
    assert t["e2e_ms"] == pytest.approx(t["queue_ms"] + t["prefill_ms"] + t["decode_ms"], abs=0.01)


def test_completion_accepts_token_ids_and_batches(client):
    a, b = TOK.encode("abc"), TOK.encode("xyz!")
    r = client.completions.create(model="fake", prompt=[a, b], max_tokens=5, temperature=0)
    assert [c.text for c in r.choices] == [expected_greedy(a, 5), expected_greedy(b, 5)]
    assert r.usage.completion_tokens == 10


def test_chat_and_stop_string(client):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    full = client.chat.completions.create(model="fake", messages=messages, max_tokens=40, temperature=0)
    expect = expected_greedy(chat_ids(messages), 40)
    assert full.choices[0].message.content == expect and full.choices[0].message.role == "assistant"
    stop = expect[10:13]
    cut = client.chat.completions.create(model="fake", messages=messages, max_tokens=40, temperature=0, stop=[stop])
    assert cut.choices[0].message.content == expect[: expect.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_streamed_chat_equals_non_streamed(client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me a story ☕"}]
    full = client.chat.completions.create(model="fake", messages=messages, max_tokens=60, temperature=0)
    chunks = list(client.chat.completions.create(model="fake", messages=messages, max_tokens=60, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == "length"
    assert finals[0].model_extra["timings"]["completion_tokens"] == 60
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 60
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    # Every delta is whole UTF-8: the multi-byte characters of the phrase never arrive split.
    assert all("\ufffd" not in (c.choices[0].delta.content or "") for c in chunks if c.choices)


def test_streamed_completion_equals_non_streamed(client):
    kw = {"model": "fake", "prompt": "naïve", "max_tokens": 33, "temperature": 0}
    full = client.completions.create(**kw)
    text = "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True) if c.choices)
    assert text == full.choices[0].text


def test_seeded_sampling_is_reproducible(client):
    kw = {"model": "fake", "prompt": "x", "max_tokens": 12, "temperature": 0.8}
    a = client.completions.create(**kw, seed=7).choices[0].text
    assert client.completions.create(**kw, seed=7).choices[0].text == a


def test_chat_logprobs_shape(client):
    r = client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                       temperature=0, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 2 for c in content)
    assert "".join(c.token for c in content) == r.choices[0].message.content


def streamed_logprobs(chunks, n):
    """Each choice's chat logprob entries, in the order its chunks brought them."""
    out = [[] for _ in range(n)]
    for c in chunks:
        for choice in c.choices:
            out[choice.index] += [e.model_dump() for e in (choice.logprobs.content if choice.logprobs else None) or ()]
    return out


STORY = [{"role": "user", "content": "Tell me a story ☕"}]


@pytest.mark.parametrize("cut", [False, True])
def test_streamed_chat_logprobs_add_up_to_the_whole_replys(client, cut):
    """Tokens whose text is held back (a stop string's possible start, a character's first bytes)
    or cut (the stop string itself) still stream their logprobs, once each and in order."""
    stop = expected_greedy(chat_ids(STORY), 60)[20:23] if cut else "never in the reply"
    kw = {"model": "fake", "messages": STORY, "max_tokens": 60, "temperature": 0, "stop": [stop], "n": 2,
          "logprobs": True, "top_logprobs": 2}
    whole = client.chat.completions.create(**kw)
    want = [[e.model_dump() for e in c.logprobs.content] for c in whole.choices]
    assert sum(map(len, want)) == whole.usage.completion_tokens and (whole.choices[0].finish_reason == "stop") == cut
    chunks = list(client.chat.completions.create(**kw, stream=True))
    assert streamed_logprobs(chunks, 2) == want
    # a token that shows no text yet has a chunk of its own, with an empty delta
    assert any(c.choices[0].logprobs and c.choices[0].delta.content is None and not c.choices[0].finish_reason
               for c in chunks if c.choices)
    with client.chat.completions.stream(**kw) as stream:  # the client's own accumulation of the chunks
        final = stream.until_done().current_completion_snapshot
    assert [[e.model_dump() for e in c.logprobs.content] for c in final.choices] == want
    assert [c.message.content for c in final.choices] == [c.message.content for c in whole.choices]


@pytest.mark.parametrize("cut", [False, True])
def test_streamed_completion_logprobs_add_up_to_the_whole_replys(client, cut):
    kw = {"model": "fake", "prompt": "naïve", "max_tokens": 40, "temperature": 0, "logprobs": 2}
    stop = expected_greedy(TOK.encode("naïve"), 40)[20:23] if cut else "never in the reply"
    whole = client.completions.create(**kw, stop=[stop]).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(**kw, stop=[stop], stream=True) if c.choices]
    assert "".join(c.text for c in chunks) == whole.text and (whole.finish_reason == "stop") == cut
    got = {f: [x for c in chunks if c.logprobs for x in getattr(c.logprobs, f)]
           for f in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
    assert got["tokens"] == whole.logprobs.tokens and got["token_logprobs"] == whole.logprobs.token_logprobs
    assert got["top_logprobs"] == whole.logprobs.top_logprobs
    # where each token's text starts; a token past the first character of a stop string that cuts
    # the text is streamed before the cut is known, at where it was generated, and the whole reply
    # puts it at the returned text's end
    assert [min(at, len(whole.text)) for at in got["text_offset"]] == whole.logprobs.text_offset
    assert got["text_offset"] == whole.logprobs.text_offset or cut
    assert any(c.text == "" and c.logprobs and not c.finish_reason for c in chunks)  # a held-back token's chunk


@pytest.mark.parametrize("fmt", ["float", "base64", "client-default"])
def test_embeddings_equal_the_models_own(client, fmt):
    """The client's default asks for base64 and decodes it itself; explicit base64 comes back raw."""
    texts = ["a cat", "the quick brown fox", "東京"]
    kw = {} if fmt == "client-default" else {"encoding_format": fmt}
    r = client.embeddings.create(model="fake-embed", input=texts, **kw)
    if fmt == "base64":
        got = np.stack([np.frombuffer(base64.b64decode(d.embedding), dtype="<f4") for d in r.data])
    else:
        got = np.array([d.embedding for d in r.data], dtype=np.float32)
    ids, mask = pad_batch([TOK.encode(t) for t in texts])
    np.testing.assert_allclose(got, fake_embed(ids, mask), rtol=1e-6, atol=1e-7)
    assert r.usage.prompt_tokens == int(mask.sum())


def test_error_bodies_parse_as_the_client_expects(client):
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "hi"}])
    assert err.value.code == "model_not_found" and err.value.param == "model"
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="fake", prompt="hi", max_tokens=-3)
    assert err.value.param == "max_tokens" and err.value.type == "invalid_request_error"
    assert "max_tokens" in err.value.message
