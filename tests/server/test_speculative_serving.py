"""Speculative decoding through the server, with the official `openai` client, on the real
default model: greedy replies, streamed and not, are token-identical to a server without it, by
n-gram lookup and by a draft model (the model itself as its own draft: same vocabulary, every
draft accepted); each reply's timings say what was drafted and accepted, and /metrics under
vLLM's prefix carries vLLM's spec_decode counters."""

import httpx
import openai
import pytest

from scratchllm.bench.http_client import metric, parse_metrics
from scratchllm.server.app import ServerConfig, create_app
from scratchllm.server.backend import load_model

pytestmark = pytest.mark.slow

# Both draft on every step they can (adaptive off): the draft-length rule decides from the time
# steps take, and on a busy machine it may draft little; these tests are about what a reply is
# and says (the model as its own draft costs as much as the model: the rule would stop drafting).
SERVERS = {"plain": None,
           "ngram": {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 2,
                     "adaptive": False},
           "draft": {"model": "default", "num_speculative_tokens": 4, "adaptive": False}}
EDIT = [{"role": "user", "content": "Return this function unchanged, in a code block:\n\n```python\n"
                                    "def area(width, height):\n    \"\"\"The area of a rectangle.\"\"\"\n"
                                    "    return width * height\n```"}]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def servers(serve_module):
    urls = {}
    stack = []
    for name, spec in SERVERS.items():
        options = {"dtype": "auto"} | ({"speculative_config": spec} if spec else {})
        app = create_app(load_model("default", "default", options), None, ServerConfig(metrics_prefix="vllm:"))
        cm = serve_module(app)
        urls[name] = cm.__enter__()
        stack.append(cm)
    yield urls
    for cm in reversed(stack):
        cm.__exit__(None, None, None)


def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def reply(url, messages, stream):
    c = client(url)
    if not stream:
        r = c.chat.completions.create(model="default", messages=messages, max_tokens=64, temperature=0,
                                      extra_body={"logprobs": True})
        return r.choices[0].message.content, r.model_extra["timings"]
    text, timings = "", None
    for chunk in c.chat.completions.create(model="default", messages=messages, max_tokens=64, temperature=0,
                                           stream=True):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            timings = (chunk.model_extra or {}).get("timings") or timings
    return text, timings


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_greedy_replies_equal_the_plain_servers(servers, method, stream):
    for messages in (EDIT, QUESTION):
        plain, plain_t = reply(servers["plain"], messages, stream)
        got, t = reply(servers[method], messages, stream)
        assert got == plain and len(plain) > 10
        assert plain_t["draft_n"] == plain_t["draft_n_accepted"] == 0
        if messages is EDIT:  # the answer repeats the prompt: drafts were verified, some accepted
            assert t["draft_n"] > 0 and 0 < t["draft_n_accepted"] <= t["draft_n"]


def test_metrics_carry_vllms_spec_decode_counters(servers):
    reply(servers["ngram"], EDIT, False)
    page = parse_metrics(httpx.get(servers["ngram"] + "/metrics").text)
    drafted = metric(page, "vllm:spec_decode_num_draft_tokens_total")
    accepted = metric(page, "vllm:spec_decode_num_accepted_tokens_total")
    drafts = metric(page, "vllm:spec_decode_num_drafts_total")
    emitted = metric(page, "vllm:spec_decode_num_emitted_tokens_total")
    # a verification emits its accepted drafts and one more, unless the reply ended on a draft
    assert drafted >= accepted > 0 and accepted < emitted <= accepted + drafts
    plain = parse_metrics(httpx.get(servers["plain"] + "/metrics").text)
    assert not [k for k in plain if "spec_decode" in str(k)]
