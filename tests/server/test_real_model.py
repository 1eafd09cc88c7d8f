"""The official `openai` client against a live server on the real default model and MiniLM.

References: the greedy answer both peers (llama.cpp, transformers) give for the capital-of-France
prompt, the prompt's token ids they agree on, and the embedding model's own output.
"""

import time

import httpx
import numpy as np
import openai
import pytest

from scratchllm.bench.http_client import metric, parse_metrics
from scratchllm.server.app import ServerConfig, create_app
from scratchllm.server.backend import load_embedder, load_model

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
REF_PROMPT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
# Reference prompt ids and greedy continuation (llama.cpp and HF transformers agree).
REF_PROMPT_IDS = [1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198]
REF_GREEDY_IDS = [504, 3575, 282, 4649, 314, 7042, 30, 2]


@pytest.fixture(scope="module")
def real(serve_module):
    model = load_model("default", "default", {})
    embedder = load_embedder("minilm")
    app = create_app(model, embedder, ServerConfig(max_in_flight=16))
    with serve_module(app) as url:
        yield url, app


@pytest.fixture(scope="module")
def client(real):
    return openai.OpenAI(base_url=real[0] + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_completion_greedy_equals_the_reference_answer(client, real):
    tok = real[1].state.server.model.tokenizer
    r = client.completions.create(model="default", prompt=REF_PROMPT, max_tokens=16, temperature=0)
    assert r.usage.prompt_tokens == len(REF_PROMPT_IDS)  # the server tokenized it as the peers do
    assert r.choices[0].text == tok.decode(REF_GREEDY_IDS[:-1]) == "The capital of France is Paris."
    assert r.choices[0].finish_reason == "stop"  # the 8th token is <|im_end|>, the EOS
    assert r.usage.completion_tokens == len(REF_GREEDY_IDS)
    t = r.model_extra["timings"]
    assert t["prompt_tokens"] == 16 and t["prefill_ms"] > 0 and t["decode_tokens_per_s"] > 0


def test_chat_uses_the_models_template(client, real):
    """The template adds SmolLM2's default system prompt; the answer is still Paris."""
    tok = real[1].state.server.model.tokenizer
    r = client.chat.completions.create(model="default", messages=QUESTION, max_tokens=16, temperature=0)
    assert r.usage.prompt_tokens == len(tok.encode(tok.apply_chat_template(QUESTION), add_special_tokens=False))
    assert "Paris" in r.choices[0].message.content


def test_streamed_chat_equals_non_streamed_greedy(client):
    messages = [{"role": "user", "content": "Write two sentences about the sea."}]
    full = client.chat.completions.create(model="default", messages=messages, max_tokens=24, temperature=0)
    chunks = list(client.chat.completions.create(model="default", messages=messages, max_tokens=24, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_streamed_logprobs_equal_the_whole_replys(client):
    """Every token's logprobs stream once and in order, the end token's (it shows no text) and
    those whose text a stop string holds back too: the chunks' entries are the whole reply's."""
    kw = {"model": "default", "max_tokens": 16, "temperature": 0, "stop": ["never in the reply"]}
    chat = {**kw, "messages": QUESTION, "logprobs": True, "top_logprobs": 3}
    whole = client.chat.completions.create(**chat).choices[0]
    chunks = [c.choices[0] for c in client.chat.completions.create(**chat, stream=True) if c.choices]
    got = [e for c in chunks if c.logprobs for e in c.logprobs.content]
    assert whole.finish_reason == "stop" and [e.token for e in got] == [e.token for e in whole.logprobs.content]
    for a, b in zip(got, whole.logprobs.content, strict=True):
        assert a.bytes == b.bytes and a.logprob == pytest.approx(b.logprob, abs=1e-6)
        assert [t.token for t in a.top_logprobs] == [t.token for t in b.top_logprobs]
        assert [t.logprob for t in a.top_logprobs] == pytest.approx([t.logprob for t in b.top_logprobs], abs=1e-6)
    cmpl = {**kw, "prompt": REF_PROMPT, "logprobs": 3}
    plain = client.completions.create(**cmpl).choices[0].logprobs
    parts = [c.choices[0].logprobs for c in client.completions.create(**cmpl, stream=True) if c.choices]
    assert [t for p in parts if p for t in p.tokens] == plain.tokens and len(plain.tokens) == len(REF_GREEDY_IDS)
    assert [x for p in parts if p for x in p.text_offset] == plain.text_offset
    assert [x for p in parts if p for x in p.token_logprobs] == pytest.approx(plain.token_logprobs, abs=1e-6)
    for a, b in zip([x for p in parts if p for x in p.top_logprobs], plain.top_logprobs, strict=True):
        assert a.keys() == b.keys() and a == pytest.approx(b, abs=1e-6)


def test_completion_on_text_and_token_ids(client, real):
    tok = real[1].state.server.model.tokenizer
    prompt = "The three primary colours are"
    a = client.completions.create(model="default", prompt=prompt, max_tokens=12, temperature=0)
    b = client.completions.create(model="default", prompt=tok.encode(prompt), max_tokens=12, temperature=0)
    assert a.choices[0].text == b.choices[0].text and a.usage.prompt_tokens == len(tok.encode(prompt))
    assert a.usage.completion_tokens == 12 or a.choices[0].finish_reason == "stop"


def test_embeddings_equal_the_models_own(client, real):
    emb = real[1].state.models.entry("minilm").embedder
    texts = ["A man is eating food.", "東京は日本の首都です。", "def f(x): return x + 1"]
    r = client.embeddings.create(model="minilm", input=texts)
    got = np.array([d.embedding for d in r.data], dtype=np.float32)
    ids, mask = emb.tokenizer.encode_batch(texts)
    np.testing.assert_allclose(got, emb.embed(ids, mask), rtol=0, atol=1e-6)
    assert r.usage.prompt_tokens == int(mask.sum())


def test_models(client):
    assert [m.id for m in client.models.list().data] == ["default", "minilm"]


def test_disconnect_returns_blocks_to_the_pool(real):
    url, app = real
    engine = app.state.server.model.engine
    body = {"model": "default", "prompt": "Count from one to a thousand:", "max_tokens": 400, "stream": True}
    with httpx.Client(timeout=60) as c, c.stream("POST", url + "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        for _ in range(6):
            next(lines)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        m = parse_metrics(httpx.get(url + "/metrics").text)
        if metric(m, "kv_blocks_used") == 0 and metric(m, "requests_in_flight") == 0:
            break
        time.sleep(0.01)
    assert metric(m, "kv_blocks_used") == 0, "blocks were not returned after the client left"
    assert [v for k, v in m.items() if k.startswith("scratchllm:request_success_total") and 'abort' in k] == [1.0]
    assert engine.stats().kv_blocks_used == 0


def test_static_engine_equals_the_continuous_engine(real):
    """`serve --batching static` (the padded baseline) gives the same greedy tokens as the engine."""
    from scratchllm.sampling import SamplingParams

    continuous = real[1].state.server.model
    static = load_model("default", "static", {"batching": "static", "max_num_seqs": 3})
    tok = continuous.tokenizer
    prompts = [REF_PROMPT, "Once upon a time", "1, 2, 3,"]  # different lengths: left padding matters
    params = [SamplingParams(max_tokens=n, temperature=0) for n in (16, 10, 6)]

    def run(engine):
        streams = [engine.submit(tok.encode(p), sp) for p, sp in zip(prompts, params, strict=True)]
        return [[(e.token_id, e.text, e.finish_reason) for e in s] for s in streams]

    try:
        assert run(static.engine) == run(continuous.engine)
        # a row's stream ends with its last token; the batch's cache is released just after
        deadline = time.monotonic() + 10
        while static.engine.stats().kv_blocks_used and time.monotonic() < deadline:
            time.sleep(0.01)
        stats = static.engine.stats()
        # the padded cache held [3 rows, longest prompt + longest output] while the batch ran
        assert stats.kv_blocks_used == 0 and stats.kv_blocks_peak >= 3 * (16 + 16) // 16
    finally:
        static.engine.shutdown()
