"""A reasoning model's thinking in `reasoning_content`: Qwen3's replies (its template's own
`<think>` blocks) and Magistral's (mistral-common's v13 template with thinking, its
`[THINK]...[/THINK]`) split from the answer, streamed and not; `enable_thinking` reaching the
template; nothing split for a template that does not think."""

import httpx
import openai
import pytest

from scratchllm.sampling import SamplingParams
from scratchllm.server.reasoning import BRACKETS, TAGS, ThinkSplitter, prompt_opens_thinking, template_thinks
from scratchllm.server.tool_calls import ReplyFormat
from tests.server.scripted import QUESTION, TOOLS, TemplateTokenizer, arguments, scripted_app, template_reply

THOUGHT = "The user asks for the weather.\nI should call the tool."
ANSWER = "It is sunny in Lyon."
QWEN3_REPLY = f"<think>\n{THOUGHT}\n</think>\n\n{ANSWER}"  # as Qwen3's template writes a thinking turn
MAGISTRAL_REPLY = "[THINK]thinking[/THINK]answer"  # as the v13 template with thinking writes one


def split(text, piece, inside=False, markers=TAGS):
    s = ThinkSplitter(markers, inside)
    parts = [s.push(text[i:i + piece]) for i in range(0, len(text), piece)] + [s.finish()]
    return "".join(r for r, _ in parts), "".join(c for _, c in parts)


@pytest.mark.parametrize("piece", [1, 2, 5, 1000])
def test_thinking_and_answer_split_in_pieces_of_any_size(piece):
    assert split(QWEN3_REPLY, piece) == (THOUGHT, ANSWER)
    assert split(f"{THOUGHT}\n</think>\n\n{ANSWER}", piece, inside=True) == (THOUGHT, ANSWER)
    assert split("No thinking here <think>x</think>", piece) == ("", "No thinking here <think>x</think>")
    assert split("<think>\ncut while thin", piece) == ("cut while thin", "")  # cut by max_tokens
    assert split("<thi", piece) == ("", "<thi")


@pytest.mark.parametrize("piece", range(1, len(MAGISTRAL_REPLY) + 1))
def test_mistral_thinking_splits_in_pieces_of_every_size(piece):
    assert split(MAGISTRAL_REPLY, piece, markers=BRACKETS) == ("thinking", "answer")
    assert split("[THINK]cut while thin", piece, markers=BRACKETS) == ("cut while thin", "")
    assert split(QWEN3_REPLY, piece, markers=BRACKETS) == ("", QWEN3_REPLY)  # not its markers
    assert split(MAGISTRAL_REPLY, piece) == ("", MAGISTRAL_REPLY)


@pytest.mark.parametrize("family,markers", [("qwen3", TAGS), ("mistral_v13_think", BRACKETS),
                                            ("mistral_v13", None), ("llama3", None)])
def test_the_markers_are_the_templates(family, markers):
    assert template_thinks(TemplateTokenizer(family).spec.chat_template) == markers


def test_special_token_markers_keep_special_tokens_in_the_text():
    """Mistral's [THINK] and [/THINK] are special tokens: a reply skipping them would lose them."""
    params = SamplingParams(max_tokens=10)
    assert ReplyFormat(thinking=BRACKETS).sampling(params).skip_special_tokens is False
    assert ReplyFormat(thinking=TAGS).sampling(params).skip_special_tokens is True


def test_a_prompt_may_open_the_thinking():
    assert prompt_opens_thinking("<|im_start|>assistant\n<think>\n", TAGS)
    assert not prompt_opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n", TAGS)
    assert not prompt_opens_thinking("<|im_start|>assistant\n", TAGS)
    assert prompt_opens_thinking("[INST]Hi[/INST][THINK]", BRACKETS)
    assert not prompt_opens_thinking("[INST]Hi[/INST][THINK]x[/THINK]ok</s>[INST]More[/INST]", BRACKETS)


def _client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=20)


def _chat(client, max_tokens):
    """The unstreamed choice, and the streamed one's (reasoning, content, finish_reason)."""
    full = client.chat.completions.create(model="fake", messages=QUESTION, max_tokens=max_tokens).choices[0]
    thought, answer, finish = "", "", None
    for chunk in client.chat.completions.create(model="fake", messages=QUESTION, max_tokens=max_tokens, stream=True):
        for c in chunk.choices:
            thought += (c.delta.model_extra or {}).get("reasoning_content") or ""
            answer += c.delta.content or ""
            finish = c.finish_reason or finish
    return full, (thought, answer, finish)


def test_qwen3_thinking_in_reasoning_content_streamed_and_not(serve):
    app, engine = scripted_app("qwen3")
    engine.reply = QWEN3_REPLY
    with serve(app) as url, _client(url) as client:
        full, streamed = _chat(client, 400)
    assert streamed == (THOUGHT, ANSWER, "stop")
    assert full.message.model_extra["reasoning_content"] == THOUGHT
    assert full.message.content == ANSWER and full.finish_reason == "stop"


def test_mistral_thinking_in_reasoning_content_streamed_and_not(serve):
    app, engine = scripted_app("mistral_v13_think")
    engine.reply = MAGISTRAL_REPLY
    with serve(app) as url, _client(url) as client:
        full, streamed = _chat(client, 400)
    assert streamed == ("thinking", "answer", "stop")
    assert full.message.model_extra["reasoning_content"] == "thinking" and full.message.content == "answer"


def test_mistral_reply_cut_inside_its_thinking(serve):
    app, engine = scripted_app("mistral_v13_think")
    engine.reply = MAGISTRAL_REPLY
    with serve(app) as url, _client(url) as client:
        full, streamed = _chat(client, len("[THINK]thin"))
    assert streamed == ("thin", "", "length")
    assert full.message.model_extra["reasoning_content"] == "thin" and full.message.content == ""
    assert full.finish_reason == "length"


@pytest.mark.parametrize("family", ["qwen3", "mistral_v13_think"])
def test_thinking_then_tool_calls(serve, family):
    app, engine = scripted_app(family)
    engine.reply = template_reply(family, [("add", {"a": 2, "b": 3})], reasoning=THOUGHT)
    with serve(app) as url, _client(url) as client:
        r = client.chat.completions.create(model="fake", messages=QUESTION, tools=TOOLS, max_tokens=400)
    msg = r.choices[0].message
    assert msg.model_extra["reasoning_content"] == THOUGHT and msg.content is None
    assert arguments(msg.tool_calls) == [("add", {"a": 2, "b": 3})] and r.choices[0].finish_reason == "tool_calls"


def test_enable_thinking_reaches_the_template(serve):
    """Qwen3's template closes an empty thinking block in the prompt when enable_thinking is false."""
    app, engine = scripted_app("qwen3")
    engine.reply = ANSWER
    tok = TemplateTokenizer("qwen3")
    with serve(app) as url:
        r = httpx.post(url + "/v1/chat/completions", json={
            "model": "fake", "messages": QUESTION, "max_tokens": 100,
            "chat_template_kwargs": {"enable_thinking": False}}).json()
    off = tok.apply_chat_template(QUESTION, enable_thinking=False)
    assert off.endswith("<think>\n\n</think>\n\n") and off != tok.apply_chat_template(QUESTION)
    assert r["usage"]["prompt_tokens"] == len(tok.encode(off))
    assert r["choices"][0]["message"] == {"role": "assistant", "content": ANSWER, "reasoning_content": None}


def test_a_template_without_thinking_has_no_reasoning_content(serve):
    app, engine = scripted_app("llama3")
    engine.reply = QWEN3_REPLY
    with serve(app) as url:
        r = httpx.post(url + "/v1/chat/completions", json={"model": "fake", "messages": QUESTION,
                                                           "max_tokens": 400}).json()
    assert r["choices"][0]["message"] == {"role": "assistant", "content": QWEN3_REPLY}


def test_a_reasoning_content_sent_back_reaches_the_template(serve):
    """An assistant message sent back with its reasoning_content is accepted (Qwen3's template shows
    it only in turns after the last user message)."""
    app, engine = scripted_app("qwen3")
    engine.reply = "ok"
    tok = TemplateTokenizer("qwen3")
    turn = {"role": "assistant", "content": ANSWER, "reasoning_content": THOUGHT}
    messages = [*QUESTION, turn, {"role": "user", "content": "Thanks"}]
    with serve(app) as url:
        r = httpx.post(url + "/v1/chat/completions", json={"model": "fake", "messages": messages, "max_tokens": 5})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len(tok.encode(tok.apply_chat_template(messages)))
