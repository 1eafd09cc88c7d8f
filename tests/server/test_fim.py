"""Fill-in-the-middle through the three ways in (/v1/completions' `suffix`, llama.cpp's /infill,
Ollama's `suffix`) over a scripted engine whose tokenizer has Qwen2.5-Coder's layout: the prompt
ids each builds, the end token that ends the middle, /infill's reply and stream in llama.cpp's
shape and its n_indent / n_predict / t_max_predict_ms stops; and the 400 a model without
fill-in-the-middle tokens answers. The real model against transformers: test_fim_real.py."""

import json

import openai
import pytest
from fastapi.testclient import TestClient

from scratchllm.engine.fake import FakeTokenizer
from scratchllm.server.app import ServerConfig, create_app
from scratchllm.server.infill import LineLimits
from scratchllm.server.state import ServedModel
from scratchllm.tokenizer.fim import FimLayout
from tests.server.scripted import ScriptedEngine

PRE, SUF, MID, REP, SEP, END = 300, 301, 302, 303, 304, 305
LAYOUT = FimLayout("qwen2.5-coder", {"pre": PRE, "suf": SUF, "mid": MID, "rep": REP, "sep": SEP}, "repo_tokens", (END,))


class FimTokenizer(FakeTokenizer):
    def fim_layout(self):
        return LAYOUT

    def token_to_id(self, text):
        return None


class FimEngine(ScriptedEngine):
    """Writes `reply`, then the layout's end token (not the EOS); remembers each prompt."""

    prompts: list

    def next_token(self, prompt, offset, n):
        if n == 0:
            self.prompts.append(list(prompt))
        data = self.reply.encode()
        return data[n] + 3 if n < len(data) else END


def app_with(tokenizer, step_ms=0.2):
    engine = FimEngine(step_ms=step_ms, max_running=8)
    engine.prompts = []
    return create_app(ServedModel("coder", engine, tokenizer, 4096), None, ServerConfig()), engine


@pytest.fixture
def fim():
    app, engine = app_with(FimTokenizer())
    with TestClient(app) as client:
        yield client, engine


def ids(text):
    return FakeTokenizer().encode(text)


def test_completions_suffix_is_the_layout_and_ends_at_the_end_token(fim):
    client, engine = fim
    engine.reply = "a + b"
    r = client.post("/v1/completions", json={"model": "coder", "prompt": "def f(a, b):\n    return ",
                                             "suffix": "\n", "max_tokens": 20})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == ("a + b", "stop")
    assert engine.prompts == [[PRE, *ids("def f(a, b):\n    return "), SUF, *ids("\n"), MID]]
    assert r.json()["usage"]["completion_tokens"] == 6  # the end token is generated, not shown


def test_ollama_suffix_is_the_same_layout(fim):
    client, engine = fim
    engine.reply = "x * x"
    r = client.post("/api/generate", json={"model": "coder", "prompt": "return ", "suffix": ";", "stream": False})
    assert r.status_code == 200, r.text
    assert (r.json()["response"], r.json()["done_reason"]) == ("x * x", "stop")
    assert engine.prompts == [[PRE, *ids("return "), SUF, *ids(";"), MID]]
    for field in ("system", "raw"):  # neither has a place in the layout
        r = client.post("/api/generate", json={"model": "coder", "prompt": "a", "suffix": "b", field: "s" if
                                               field == "system" else True, "stream": False})
        assert r.status_code == 400 and field in r.json()["error"]


def test_infill_lays_out_input_extra_as_the_repository_and_answers_as_llama_cpp(fim):
    client, engine = fim
    engine.reply = "a - b"
    body = {"input_prefix": "def diff(a, b):\n", "prompt": "    return ", "input_suffix": "\n",
            "input_extra": [{"filename": "util.py", "text": "def sub(a, b):\n    return a - b\n", "time": 1.5}],
            # the rest of what llama.vscode sends
            "n_predict": 16, "top_k": 40, "top_p": 0.99, "stream": False, "samplers": ["top_k", "top_p", "infill"],
            "cache_prompt": True, "t_max_prompt_ms": 500, "t_max_predict_ms": 1000, "n_indent": 4}
    for path in ("/infill", "/v1/infill"):
        r = client.post(path, json=body)
        assert r.status_code == 200, r.text
        got = r.json()
        assert got["content"] == "a - b" and got["stop"] is True and got["stop_type"] == "eos"
        assert got["tokens_predicted"] == 6 and got["tokens_evaluated"] == len(engine.prompts[-1])
        assert set(got["timings"]) >= {"prompt_n", "prompt_ms", "predicted_n", "predicted_ms"}
    assert engine.prompts[0] == [REP, *ids("myproject\n"), SEP, *ids("util.py\ndef sub(a, b):\n    return a - b\n"),
                                 SEP, *ids("filename\n"), PRE, *ids("def diff(a, b):\n    return "), SUF, *ids("\n"),
                                 MID]


def test_infill_streams_llama_cpp_lines(fim):
    client, engine = fim
    engine.reply = "one\ntwo"
    r = client.post("/infill", json={"input_prefix": "x = ", "input_suffix": "", "stream": True, "n_predict": 20})
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    assert "".join(e["content"] for e in events) == "one\ntwo"
    assert all(e["stop"] is False for e in events[:-1]) and events[-1]["stop"] is True
    assert events[-1]["stop_type"] == "eos" and "[DONE]" not in r.text


def test_infill_n_predict_0_only_runs_the_prompt(fim):
    client, engine = fim
    engine.reply = "ignored"
    r = client.post("/infill", json={"input_prefix": "a", "input_suffix": "b", "n_predict": 0, "samplers": []})
    assert r.status_code == 200 and r.json()["content"] == "" and r.json()["tokens_predicted"] == 0


def test_infill_n_indent_ends_at_a_line_indented_less(fim):
    client, engine = fim
    engine.reply = "x = 1\n        y = 2\n    z = 3\n"
    r = client.post("/infill", json={"input_prefix": "    ", "input_suffix": "", "n_indent": 8, "n_predict": 40})
    assert (r.json()["content"], r.json()["stop_type"]) == ("x = 1\n        y = 2\n    ", "limit")


def test_infill_stop_word_and_n_predict(fim):
    client, engine = fim
    engine.reply = "alpha beta gamma"
    r = client.post("/infill", json={"input_prefix": "", "input_suffix": "", "stop": [" gam"]}).json()
    assert (r["content"], r["stop_type"], r["stopping_word"]) == ("alpha beta", "word", " gam")
    r = client.post("/infill", json={"input_prefix": "", "input_suffix": "", "n_predict": 3}).json()
    assert (r["content"], r["stop_type"]) == ("alp", "limit")


def test_infill_t_max_predict_ms_ends_after_a_newline():
    app, engine = app_with(FimTokenizer(), step_ms=20)
    engine.reply = "a\n" + "b" * 200
    with TestClient(app) as client:
        r = client.post("/infill", json={"input_prefix": "", "input_suffix": "", "t_max_predict_ms": 100})
    got = r.json()
    assert got["stop_type"] == "limit" and got["content"].startswith("a\nb") and len(got["content"]) < 100


def test_infill_refuses_what_it_cannot_honour(fim):
    client, _ = fim
    for body, param in [({"input_prefix": "a", "foo": 1}, "foo"), ({"input_prefix": "a", "lora": [{"id": 0}]}, "lora"),
                        ({"input_prefix": "a", "input_extra": [{"filename": "a", "text": "b", "x": 1}]},
                         "input_extra.0.x"), ({"input_prefix": "a", "n_predict": -2}, "n_predict")]:
        r = client.post("/infill", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_suffix_with_echo_or_token_ids_is_refused(fim):
    client, _ = fim
    for body, param in [({"prompt": "a", "suffix": "b", "echo": True}, "echo"), ({"prompt": [5, 6], "suffix": "b"},
                                                                              "prompt")]:
        r = client.post("/v1/completions", json={"model": "coder", **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_a_model_without_fim_tokens_is_a_400_naming_what_it_lacks():
    app, _ = app_with(FakeTokenizer())
    with TestClient(app) as client:
        for path, body, param in [("/v1/completions", {"model": "coder", "prompt": "a", "suffix": "b"}, "suffix"),
                                  ("/infill", {"input_prefix": "a", "input_suffix": "b"}, "input_suffix")]:
            r = client.post(path, json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == param
            assert "fill-in-the-middle" in r.json()["error"]["message"]
        r = client.post("/api/generate", json={"model": "coder", "prompt": "a", "suffix": "b", "stream": False})
        assert r.status_code == 400 and "fill-in-the-middle" in r.json()["error"]
        # an empty suffix is no fill-in-the-middle: plain completion
        assert client.post("/v1/completions", json={"model": "coder", "prompt": "a", "suffix": ""}).status_code == 200


def test_line_limits_hold_an_undecided_indentation():
    limits = LineLimits(n_indent=4, t_max_predict_ms=0)
    assert limits.push("x = 1\n  ") == ("x = 1\n", False)  # the indentation could still grow
    assert limits.push("  y") == ("    y", False)
    assert limits.push("\nz") == ("\n", True)  # z at indent 0 < 4: the text ends before it
    assert limits.text == "x = 1\n    y\n"


def test_the_official_client_sends_suffix(serve):
    app, engine = app_with(FimTokenizer())
    engine.reply = "middle"
    with serve(app) as url, openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0) as client:
        got = client.completions.create(model="coder", prompt="before ", suffix=" after", max_tokens=10)
    assert got.choices[0].text == "middle" and got.choices[0].finish_reason == "stop"
    assert engine.prompts == [[PRE, *ids("before "), SUF, *ids(" after"), MID]]


def test_the_docs_list_every_infill_field_with_a_status():
    import re
    from pathlib import Path

    from scratchllm.server.infill import InfillRequest

    text = (Path(__file__).parents[2] / "docs" / "fill-in-the-middle.md").read_text()
    section = text.split("## /infill\n")[1]
    rows = re.findall(r"^\| (`[a-z_]+`(?:, `[a-z_]+`)*) \| ([a-z ,]+?) \|", section, flags=re.M)
    documented = {name: status for names, status in rows for name in re.findall(r"`([a-z_]+)`", names)}
    assert set(InfillRequest.model_fields) == set(documented)
    assert set(documented.values()) <= {"implemented", "refused unless neutral", "accepted, no effect"}


def test_infill_is_captured_as_the_completions_request_it_runs_as(tmp_path):
    from scratchllm.evaluate.capture import CaptureWriter
    from scratchllm.evaluate.sources import read_traffic

    engine = FimEngine(step_ms=0.2, max_running=8)
    engine.prompts, engine.reply = [], "a - b"
    capture = CaptureWriter(tmp_path / "cap", rate=1.0, key="k")
    app = create_app(ServedModel("coder", engine, FimTokenizer(), 4096), None, ServerConfig(), capture=capture)
    with TestClient(app) as client:
        got = client.post("/infill", json={"input_prefix": "x = ", "input_suffix": "\n", "n_predict": 9,
                                           "temperature": 0}).json()
    (captured,) = read_traffic(tmp_path / "cap").requests
    assert (captured.endpoint, captured.translated_from) == ("/v1/completions", "/infill")
    assert captured.body["prompt"] == engine.prompts[0] and captured.body["stop_token_ids"] == [END]
    assert captured.body["max_tokens"] == 9 and captured.response["text"] == got["content"] == "a - b"
