"""Every end-of-generation token ends generation on the real Qwen2.5-Coder-0.5B: a raw prompt
whose greedy continuation is a newline and then <|endoftext|> (151643, which is not the file's
EOS, <|im_end|>) stops there with finish_reason "stop" on LLM.generate, /v1/completions and
Ollama's /api/generate; ignore_eos runs past it."""

import httpx
import pytest

from scratchllm.engine.async_engine import AsyncEngine
from scratchllm.llm import LLM
from scratchllm.sampling import SamplingParams
from scratchllm.server.app import ServerConfig, create_app
from scratchllm.server.state import ServedModel

pytestmark = pytest.mark.slow

# A finished chat as raw text: the model ends the document after it (its training data does).
PROMPT = "<|im_start|>user\nSay hi.<|im_end|>\n<|im_start|>assistant\nHi!<|im_end|>"
NEWLINE, ENDOFTEXT = 198, 151643


@pytest.fixture(scope="module")
def qwen():
    llm = LLM("qwen2.5-coder-0.5b")
    yield llm
    llm.shutdown()


def test_endoftext_ends_a_raw_prompt_on_every_endpoint(qwen, serve):
    tok = qwen.tokenizer
    assert tok.eos_token_id != ENDOFTEXT and ENDOFTEXT in tok.end_token_ids and tok.id_to_token(ENDOFTEXT) == \
        "<|endoftext|>"
    out = qwen.generate(PROMPT, SamplingParams(max_tokens=16, temperature=0.0, logprobs=2))[0]
    assert out.token_ids == [NEWLINE, ENDOFTEXT] and out.finish_reason == "stop" and out.text == "\n"
    (_, top), = out.logprobs[1:]
    assert top[0][0] == ENDOFTEXT and top[0][1] - top[1][1] > 1.0, top  # greedy's choice, not a near tie
    past = qwen.generate(PROMPT, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))[0]
    assert past.token_ids[:2] == [NEWLINE, ENDOFTEXT] and len(past.token_ids) == 5 and past.finish_reason == "length"

    engine = AsyncEngine(qwen.engine)  # the server's engine thread owns the engine from here on
    try:
        app = create_app(ServedModel("qwen", engine, tok, qwen.max_model_len), None, ServerConfig())
        with serve(app) as url:
            r = httpx.post(url + "/v1/completions", timeout=120,
                           json={"model": "qwen", "prompt": PROMPT, "max_tokens": 16, "temperature": 0})
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["choices"][0]["text"] == "\n" and body["choices"][0]["finish_reason"] == "stop"
            assert body["usage"]["completion_tokens"] == 2
            r = httpx.post(url + "/api/generate", timeout=120,
                           json={"model": "qwen", "prompt": PROMPT, "raw": True, "stream": False,
                                 "options": {"temperature": 0, "num_predict": 16}})
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["response"] == "\n" and body["done_reason"] == "stop" and body["eval_count"] == 2
    finally:
        engine.shutdown(drain=False)
