"""One `scratchllm serve` holding the real default model, MiniLM and Gemma 3 270M, each loaded on
its first request: requests to each by name through the official `openai` client; every model
unloaded after its keep-alive and loaded again by the next request, as /v1/models and /metrics
show; the official `ollama` client against the same server, its JSON-schema output checked by
jsonschema.

References: the greedy answer llama.cpp and transformers both give for the capital-of-France
prompt (test_real_model.py), MiniLM's own embeddings, jsonschema."""

import json
import time

import httpx
import jsonschema
import numpy as np
import ollama
import openai
import pytest

from scratchllm.bench.http_client import parse_metrics
from scratchllm.server.backend import load_embedder
from scratchllm.tokenizer import Tokenizer
from tests.server.test_ollama_api import scratchllm_serve
from tests.server.test_real_model import QUESTION, REF_GREEDY_IDS

pytestmark = pytest.mark.slow

KEEP_ALIVE_S = 6
# bounded strings: a 135M model's greedy digits can run on, and the test is the grammar, not the model
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                           "country": {"type": "string", "maxLength": 24}},
          "required": ["city", "country"], "additionalProperties": False}


def states(url):
    return {m["id"]: m["state"] for m in httpx.get(url + "/v1/models").json()["data"]}


def metric(url, name, model):
    return parse_metrics(httpx.get(url + "/metrics").text).get(f'scratchllm:{name}{{model_name="{model}"}}')


def test_three_real_models_in_one_server():
    options = ("--keep-alive", str(KEEP_ALIVE_S), "--load", "first-use", "--max-num-seqs", "4", "--max-model-len",
               "2048", "--trace", "none")
    with scratchllm_serve("default", "gemma3-270m", *options, timeout_s=120) as (url, _):
        assert states(url) == {"default": "unloaded", "minilm": "unloaded", "gemma3-270m": "unloaded"}
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
        # Gemma first: its first load (packing) is the slow one; the others then load within its keep-alive
        gemma = client.completions.create(model="gemma3-270m", prompt="The capital of France is", max_tokens=6,
                                          temperature=0)
        assert gemma.model == "gemma3-270m" and gemma.usage.completion_tokens == 6 and gemma.choices[0].text
        answer = client.chat.completions.create(model="default", messages=QUESTION, max_tokens=16, temperature=0)
        expected = Tokenizer.from_pretrained("default").decode(REF_GREEDY_IDS, skip_special_tokens=True)
        assert answer.choices[0].message.content == expected
        texts = ["A man is eating food.", "東京は日本の首都です。"]
        got = np.array([d.embedding for d in client.embeddings.create(model="minilm", input=texts).data])
        assert states(url) == {"default": "loaded", "minilm": "loaded", "gemma3-270m": "loaded"}
        assert metric(url, "generation_tokens_total", "gemma3-270m") == 6
        assert metric(url, "generation_tokens_total", "default") == answer.usage.completion_tokens
        emb = load_embedder("minilm")
        np.testing.assert_allclose(got, emb.embed(*emb.tokenizer.encode_batch(texts)), rtol=0, atol=1e-6)

        # the Ollama client, same server: the same greedy answer, and a schema's JSON
        with ollama.Client(host=url, timeout=300) as olla:
            reply = olla.chat(model="default", messages=QUESTION, options={"temperature": 0, "num_predict": 16})
            assert reply.message.content == expected and reply.done_reason == "stop"
            shaped = olla.chat(model="default", messages=[{"role": "user", "content": "Describe Paris as JSON."}],
                               format=SCHEMA, options={"temperature": 0, "num_predict": 200})
            assert shaped.done_reason == "stop", shaped.message.content  # the grammar closed the object
            jsonschema.validate(json.loads(shaped.message.content), SCHEMA)
            assert "default" in {m.model for m in olla.ps().models}

        deadline = time.monotonic() + 10 * KEEP_ALIVE_S
        while set(states(url).values()) != {"unloaded"}:
            assert time.monotonic() < deadline, states(url)
            time.sleep(0.2)
        for name in ("default", "minilm", "gemma3-270m"):
            assert metric(url, "model_loaded", name) == 0 and metric(url, "model_unloads_total", name) == 1
        again = client.completions.create(model="gemma3-270m", prompt="The capital of France is", max_tokens=6,
                                          temperature=0)
        assert again.choices[0].text == gemma.choices[0].text  # the same model, loaded again
        assert states(url)["gemma3-270m"] == "loaded" and metric(url, "model_loads_total", "gemma3-270m") == 2
        assert metric(url, "model_loaded", "gemma3-270m") == 1 and metric(url, "model_loads_total", "default") == 1
