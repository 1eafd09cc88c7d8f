"""Ollama's model management (server/model_names.py) through the official `ollama` client against
`scratchllm serve default`: pull from a local fake Hugging Face Hub (tests/formats/fake_hub.py),
create (structured fields, and the older Modelfile text, with SYSTEM, PARAMETER and MESSAGE),
copy, delete and list, each followed by a chat through the new name, compared with the same
request written out on OpenAI's route; the names kept in the user's names file, so `models list`
shows them and a restarted `serve NAME` applies what the name adds; the API key guards them."""

import json
import subprocess
import sys

import httpx
import ollama
import pytest

from scratchllm.formats import names
from scratchllm.server import modelfile
from scratchllm.server.errors import APIError
from scratchllm.server.profiles import with_profile
from scratchllm.server.registry import ModelRegistry, ModelSpec
from tests.formats.fake_hub import FakeHub

from .test_ollama_api import scratchllm_serve

KEY = "manage-key"
SERVE = ("--embedding-model", "none", "--max-model-len", "512", "--kv-cache-memory", "32MiB", "--max-num-seqs", "2",
         "--api-key", KEY)
GREEDY = {"temperature": 0, "num_predict": 8}
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture
def hub(tmp_path, monkeypatch, default_gguf):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "no-ollama"))
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    with FakeHub() as fake:
        fake.add("org/Smol-GGUF", "smol.gguf", default_gguf.read_bytes())
        fake.add("org/Smol-GGUF", "README.md", b"# Smol\n", lfs=False)
        monkeypatch.setenv("HF_ENDPOINT", fake.url)
        yield fake


def openai_chat(url, model, messages, **fields):
    r = httpx.post(url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                   json={"model": model, "messages": messages, **fields})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


@pytest.mark.slow
def test_pull_create_copy_delete_and_list_with_the_ollama_client(hub, tmp_path, default_gguf):
    with scratchllm_serve("default", *SERVE, timeout_s=120) as (url, _):
        with ollama.Client(host=url, timeout=120) as stranger:
            with pytest.raises(ollama.ResponseError) as refused:
                stranger.pull("org/Smol-GGUF/smol.gguf")
            assert refused.value.status_code == 401
        with ollama.Client(host=url, timeout=120, headers={"Authorization": f"Bearer {KEY}"}) as client:

            # pull: Ollama's status lines, with the file's total and completed bytes
            lines = list(client.pull("org/Smol-GGUF/smol.gguf", stream=True))
            statuses = [line.status for line in lines]
            assert statuses[0] == "pulling manifest" and statuses[-1] == "success", statuses
            size = default_gguf.stat().st_size
            done = [line for line in lines if line.total == size and line.completed == size]
            assert done and done[-1].status == "pulling org/Smol-GGUF/smol.gguf"
            assert "org/Smol-GGUF/smol.gguf" in [m.model for m in client.list().models]
            pulled = client.chat("org/Smol-GGUF/smol.gguf", QUESTION, options=GREEDY).message.content
            assert pulled == client.chat("default", QUESTION, options=GREEDY).message.content and pulled

            # create: SYSTEM and PARAMETER apply to every request through the name, on both APIs
            system = "You answer in one word."
            client.create(model="terse", from_="default", system=system,
                          parameters={"temperature": 0, "num_predict": 6, "stop": ["\n"]})
            written_out = openai_chat(url, "default", [{"role": "system", "content": system}, *QUESTION],
                                      temperature=0, max_tokens=6, stop=["\n"])
            assert client.chat("terse", QUESTION).message.content == written_out
            assert openai_chat(url, "terse", QUESTION) == written_out
            assert openai_chat(url, "terse:latest", QUESTION) == written_out
            # the request's own fields win over the name's
            assert openai_chat(url, "terse", QUESTION, max_tokens=2) == openai_chat(
                url, "default", [{"role": "system", "content": system}, *QUESTION], temperature=0, max_tokens=2,
                stop=["\n"])

            # the older Modelfile text, with MESSAGE lines
            text = ("FROM default\nSYSTEM \"\"\"You are a pirate.\nSpeak like one.\"\"\"\nPARAMETER temperature 0\n"
                    "PARAMETER num_predict 7\nMESSAGE user Hello\nMESSAGE assistant Arr!\n")
            r = httpx.post(url + "/api/create", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                           json={"model": "pirate", "modelfile": text, "stream": False})
            assert r.status_code == 200 and r.json() == {"status": "success"}, r.text
            pirate = [{"role": "system", "content": "You are a pirate.\nSpeak like one."},
                      {"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Arr!"}, *QUESTION]
            assert client.chat("pirate", QUESTION).message.content == openai_chat(url, "default", pirate, temperature=0,
                                                                                   max_tokens=7)

            # copy: the same model and what its name adds, under another name
            client.copy("terse", "terse-copy")
            assert client.chat("terse-copy", QUESTION).message.content == written_out
            listed = [m.model for m in client.list().models]
            assert {"terse:latest", "terse-copy:latest", "pirate:latest"} <= set(listed)

            # delete: the name goes; the model it named stays; a pulled model's files go
            client.delete("terse-copy")
            with pytest.raises(ollama.ResponseError) as gone:
                client.chat("terse-copy", QUESTION)
            assert gone.value.status_code == 404
            assert "terse-copy:latest" not in [m.model for m in client.list().models]
            assert client.chat("terse", QUESTION).message.content == written_out
            with pytest.raises(ollama.ResponseError) as kept:
                client.delete("default")
            assert kept.value.status_code == 400
            client.delete("org/Smol-GGUF/smol.gguf")
            assert not list((tmp_path / "hub").glob("models--org--Smol-GGUF/snapshots/*/smol.gguf"))
            with pytest.raises(ollama.ResponseError) as unknown:
                client.delete("never-made")
            assert unknown.value.status_code == 404

    # the names outlive the server: `models list` shows them, `serve terse` applies them
    assert set(names.all_names()) == {"terse:latest", "pirate:latest"}
    listed = json.loads(subprocess.run([sys.executable, "-m", "scratchllm.cli.main", "models", "list", "--json"],
                                       capture_output=True, text=True, check=True).stdout)
    mine = {m["name"]: m for m in listed["models"] if m["store"] == "name"}
    assert mine["terse:latest"]["path"] == str(default_gguf)
    with scratchllm_serve("terse", *SERVE, timeout_s=120) as (url, _):
        assert openai_chat(url, "terse", QUESTION) == written_out


def test_a_modelfile_is_read_line_by_line_and_refused_by_its_line():
    text = ('# a comment\nfrom ./m.gguf\nSYSTEM "One line."\nPARAMETER stop "<|end|>"\nPARAMETER stop END\n'
            'PARAMETER top_k 20\nPARAMETER temperature 0.5\nTEMPLATE """{{ messages }}\n"""\n'
            "MESSAGE user Hi there\nMESSAGE assistant Hello\n")
    assert modelfile.parse(text) == {
        "from": "./m.gguf", "system": "One line.", "template": "{{ messages }}",
        "parameters": {"stop": ["<|end|>", "END"], "top_k": 20, "temperature": 0.5},
        "messages": [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello"}]}
    for bad, said in (("FROM x\nADAPTER ./lora.gguf", "line 2: ADAPTER"), ("FROM x\nQUANTIZE q4", "line 2: unknown"),
                      ("MESSAGE robot hi", "line 1: MESSAGE role"), ('SYSTEM """never closed', "never closed"),
                      ("PARAMETER temperature", "PARAMETER needs")):
        with pytest.raises(APIError, match=said):
            modelfile.parse(bad)


def test_what_a_name_adds_and_what_the_request_keeps():
    registry = ModelRegistry([ModelSpec("m", "generate", None)])
    registry.profiles["bot"] = names.Named("bot", "m", system="Be brief.", parameters={
        "temperature": 0.1, "num_predict": 5, "repeat_penalty": 1.1}, messages=({"role": "user", "content": "a"},))
    body = {"model": "bot", "messages": [{"role": "user", "content": "q"}], "temperature": 0.9}
    assert with_profile(registry, body) == {
        "model": "bot", "temperature": 0.9, "max_tokens": 5, "repetition_penalty": 1.1,
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "a"},
                     {"role": "user", "content": "q"}]}
    own_system = {"model": "bot", "messages": [{"role": "system", "content": "mine"}], "max_completion_tokens": 9}
    out = with_profile(registry, own_system)
    assert out["messages"][0] == {"role": "system", "content": "mine"} and "max_tokens" not in out
    assert with_profile(registry, {"model": "m", "prompt": "x"}) == {"model": "m", "prompt": "x"}


def test_create_refuses_what_it_cannot_serve(serve):
    from scratchllm.server.app import ServerConfig, create_app
    from scratchllm.server.backend import fake_specs

    registry = ModelRegistry(fake_specs(["fake"], embedder=False))
    with serve(create_app(registry, config=ServerConfig())) as url:
        def create(**body):
            return httpx.post(url + "/api/create", json={"stream": False, **body})

        assert create(model="x", **{"from": "fake"}, parameters={"mirostat": 2}).status_code == 400
        go = create(model="x", **{"from": "fake"}, template="{{ .System }} {{ .Prompt }}")
        assert go.status_code == 400 and "Go's template syntax" in go.json()["error"]
        assert create(model="x", **{"from": "nothing-like-it"}).status_code == 404
        assert create(model="x").status_code == 400  # from nothing
        assert create(model="fake", **{"from": "fake"}, system="s").status_code == 409  # a started model's name
        assert create(model="x", files={"m.gguf": "sha256:" + "0" * 64}).status_code == 400  # no such blob
        ok = create(model="x", **{"from": "fake"}, system="s")
        assert ok.status_code == 200 and names.lookup("x").system == "s"
        assert "x:latest" in [m["name"] for m in httpx.get(url + "/api/tags").json()["models"]]
        assert httpx.request("DELETE", url + "/api/delete", json={"model": "x"}).status_code == 200
        assert names.lookup("x") is None


def test_create_from_an_uploaded_gguf_blob(serve, small_file):
    from scratchllm.server.app import ServerConfig, create_app
    from scratchllm.server.backend import fake_specs

    registry = ModelRegistry(fake_specs(["fake"], embedder=False))
    registry.new_spec = lambda name, ref: fake_specs([name], embedder=False)[0]
    with serve(create_app(registry, config=ServerConfig(max_body_bytes=1024))) as url, \
            ollama.Client(host=url, timeout=30) as client:
        digest = client.create_blob(small_file)  # larger than --max-body-bytes: blobs stream to disk
        assert httpx.head(f"{url}/api/blobs/{digest}").status_code == 200
        assert httpx.head(f"{url}/api/blobs/sha256:{'1' * 64}").status_code == 404
        wrong = httpx.post(f"{url}/api/blobs/sha256:{'1' * 64}", content=b"other bytes")
        assert wrong.status_code == 400 and "not sha256:" in wrong.json()["error"]
        client.create(model="local", files={"m.gguf": digest}, system="Hi")
        assert names.lookup("local").base.endswith(digest.replace(":", "-"))
        assert client.chat("local", QUESTION, options={"num_predict": 3}).message.content


@pytest.fixture
def small_file(tmp_path):
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF" + bytes(range(256)) * 40)
    return path


def test_a_name_made_from_an_earlier_name_shares_the_served_model(serve):
    from scratchllm.server.app import ServerConfig, create_app
    from scratchllm.server.backend import fake_specs

    names.save(names.Named("old", "fake", system="From before."))  # made by an earlier server
    registry = ModelRegistry(fake_specs(["fake"], embedder=False))
    with serve(create_app(registry, config=ServerConfig())) as url:
        r = httpx.post(url + "/api/create", json={"model": "new", "from": "old:latest", "stream": False})
        assert r.status_code == 200, r.text
        assert registry.entries["new:latest"] is registry.entries["fake"]  # one engine, no second load
        assert registry.profiles["new:latest"].system == "From before."
