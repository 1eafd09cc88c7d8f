"""Two replicas of the default model (SmolLM2-135M-Instruct) behind the ingress, on the shared
local Ray cluster, with the official `openai` client. Reference: the greedy answer llama.cpp and
Hugging Face transformers both give for the capital-of-France prompt."""

import time

import httpx
import openai
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

REF_PROMPT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
REF_ANSWER = "The capital of France is Paris."  # greedy, then <|im_end|> (both peers agree)
LONG_SYSTEM = "You are a geography tutor. Answer in one short sentence and name the country. " * 4


@pytest.fixture(scope="module")
def default_cluster(ray_cluster):
    from ray import serve

    from scratchllm.cluster.app import ClusterSpec, build_app
    from scratchllm.cluster.replica import ReplicaSpec

    spec = ClusterSpec(replicas=2, replica=ReplicaSpec("default", {"max_num_seqs": 4, "num_kv_blocks": 128}),
                       replica_cpus=0, report_interval_s=0.3, served_model_name="default")
    serve.run(build_app(spec), name="default-model", route_prefix="/default")
    yield f"{ray_cluster}/default"
    serve.delete("default-model")


@pytest.fixture(scope="module")
def client(default_cluster):
    return openai.OpenAI(base_url=f"{default_cluster}/v1", api_key="unused", max_retries=0, timeout=120)


def test_greedy_answer_through_the_ingress_equals_the_reference(client):
    r = client.completions.create(model="default", prompt=REF_PROMPT, max_tokens=16, temperature=0)
    assert r.choices[0].text == REF_ANSWER and r.choices[0].finish_reason == "stop"


def test_streaming_and_the_prefix_cache_on_two_real_replicas(client, default_cluster):
    messages = [{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": "Where is Lyon?"}]
    whole = client.chat.completions.create(model="default", messages=messages, max_tokens=12, temperature=0)
    assert whole.usage.prompt_tokens_details.cached_tokens == 0  # nothing seen this prompt yet
    time.sleep(1.0)  # a report from the replica that computed it
    chunks = list(client.chat.completions.create(model="default", messages=messages, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    prompt_tokens = chunks[-1].usage.prompt_tokens
    # routed to the replica holding the prompt: all its full blocks but the one with the last token
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 16 * ((prompt_tokens - 1) // 16) > 0
    accuracy = httpx.get(f"{default_cluster}/cluster/stats").json()["accuracy"]
    assert accuracy["requests"] >= 3 and accuracy["exact"] == accuracy["requests"]
