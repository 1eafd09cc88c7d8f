"""The prompt's logprobs on /v1/completions: echo with logprobs (OpenAI's legacy shape, what
lm-evaluation-harness's loglikelihood requests read), max_tokens 0, and vLLM's prompt_logprobs,
streamed and not; on the default model equal to transformers' log-softmax of a full forward."""

import json

import httpx
import numpy as np
import openai
import pytest

from scratchllm.engine.fake import FakeTokenizer
from scratchllm.server.app import ServerConfig, create_app
from scratchllm.server.backend import load_model

PROMPT = "The cat sat"
IDS = FakeTokenizer().encode(PROMPT)  # the fake's tokens: one per byte


def post(url, **body):
    r = httpx.post(url + "/v1/completions", json={"model": "fake", "prompt": PROMPT, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_echo_with_logprobs_puts_the_prompt_tokens_first(fake_server):
    url, _ = fake_server
    choice = post(url, echo=True, logprobs=1, max_tokens=3)["choices"][0]
    lp = choice["logprobs"]
    n = len(IDS)
    assert choice["text"].startswith(PROMPT) and lp["tokens"][:n] == list(PROMPT)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None  # nothing comes before the first
    assert lp["token_logprobs"][1:n] == [-1.0] * (n - 1)  # the fake engine's stand-in values
    assert len(lp["tokens"]) == n + 3 and lp["text_offset"][:n + 1] == list(range(n + 1))


def test_max_tokens_0_with_echo_is_the_prompt_alone(fake_server):
    """lm-evaluation-harness's loglikelihood body: token ids, echo, logprobs 1, max_tokens 0."""
    url, _ = fake_server
    body = post(url, prompt=IDS, echo=True, logprobs=1, max_tokens=0, seed=1234)
    (choice,) = body["choices"]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    assert len(choice["logprobs"]["tokens"]) == len(IDS) and body["usage"]["completion_tokens"] == 0
    r = httpx.post(url + "/v1/completions", json={"model": "fake", "prompt": PROMPT, "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_vllm_prompt_logprobs_shape(fake_server):
    url, _ = fake_server
    choice = post(url, prompt_logprobs=1, max_tokens=2)["choices"][0]
    plp = choice["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(IDS)
    for token, entry in zip(IDS[1:], plp[1:], strict=True):
        assert entry[str(token)] == {"logprob": -1.0, "rank": 1, "decoded_token": chr(token - 3)}
    assert choice["logprobs"] is None and not choice["text"].startswith(PROMPT)


def test_streamed_echo_brings_the_prompt_logprobs_first(fake_server):
    url, _ = fake_server
    with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=20) as client:
        chunks = list(client.completions.create(model="fake", prompt=PROMPT, echo=True, logprobs=0, max_tokens=3,
                                                temperature=0, stream=True, extra_body={"prompt_logprobs": 0}))
    first = chunks[0].choices[0]
    assert first.text == PROMPT and first.logprobs.tokens == list(PROMPT)
    assert first.logprobs.token_logprobs[0] is None and len(first.model_extra["prompt_logprobs"]) == len(IDS)
    unstreamed = post(url, echo=True, logprobs=0, max_tokens=3)["choices"][0]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == unstreamed["text"]


# --- the default model against transformers -------------------------------------------------
PROMPTS = ["The capital of France is Paris.", "def add(a, b):\n    return a + b",
           "Once upon a time, there was a little fox who", "1, 2, 3, 5, 8, 13, 21",
           "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\nParis"]


@pytest.mark.slow
def test_prompt_logprobs_equal_transformers_on_the_default_model(serve, default_gguf):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tests.gguf_reference import gguf_model

    reference = gguf_model(default_gguf)  # transformers reads the same GGUF, dequantized to float32
    # chunks of 8 tokens: every prompt's prefill runs in several steps
    served = load_model("default", "default", {"dtype": "float32", "kv_cache_dtype": "float32",
                                                "max_num_batched_tokens": 8})
    worst = 0.0
    with serve(create_app(served, None, ServerConfig())) as url, \
            openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120) as client:
        for text in PROMPTS:
            ids = served.tokenizer.encode(text)
            r = client.completions.create(model="default", prompt=ids, echo=True, logprobs=1, max_tokens=0,
                                          temperature=0)
            got = r.choices[0].logprobs.token_logprobs
            with torch.no_grad():
                logits = reference(torch.tensor(ids)[None]).logits[0].double()
            want = torch.log_softmax(logits, -1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].numpy()
            assert got[0] is None and len(got) == len(ids)
            worst = max(worst, float(np.abs(np.array(got[1:]) - want).max()))
    print(json.dumps({"prompts": len(PROMPTS), "max_abs_logprob_diff": worst}))
    assert worst <= 1e-4, worst
