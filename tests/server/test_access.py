"""Access and conventions: the API key (the official client's AuthenticationError), CORS
preflights from an allowed and a refused origin, /tokenize, /detokenize, /version,
/v1/models/{id}, and serve's options from the environment."""

import httpx
import openai
import pytest

import scratchllm
from scratchllm.cli import serve_cmd
from scratchllm.cli.main import build_parser
from scratchllm.errors import ConfigError
from scratchllm.server.app import ServerConfig, create_app
from scratchllm.server.backend import fake_backend

KEY = "sk-test-7d1f"
ORIGIN = "http://localhost:3000"


@pytest.fixture(scope="module")
def guarded(serve_module):
    model, embedder = fake_backend(step_ms=0.5)
    app = create_app(model, embedder, ServerConfig(api_key=KEY, allowed_origins=(ORIGIN,)))
    with serve_module(app) as url:
        yield url


def test_the_key_is_required_and_checked(guarded):
    for key in ("wrong-key", KEY[:-1]):
        client = openai.OpenAI(base_url=guarded + "/v1", api_key=key, max_retries=0)
        with pytest.raises(openai.AuthenticationError) as err:
            client.completions.create(model="fake", prompt="hi", max_tokens=2)
        assert err.value.status_code == 401 and err.value.code == "invalid_api_key"
    r = httpx.post(guarded + "/v1/completions", json={"model": "fake", "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 401 and "No API key" in r.json()["error"]["message"]
    good = openai.OpenAI(base_url=guarded + "/v1", api_key=KEY, max_retries=0)
    assert good.completions.create(model="fake", prompt="hi", max_tokens=2).choices[0].text
    assert httpx.get(guarded + "/health").status_code == 200  # probes need no key
    assert httpx.get(guarded + "/metrics").status_code == 200


def test_cors_preflight_from_an_allowed_and_a_refused_origin(guarded):
    ask = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}
    ok = httpx.options(guarded + "/v1/chat/completions", headers={"Origin": ORIGIN, **ask})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == ORIGIN
    assert "authorization" in ok.headers["access-control-allow-headers"].lower()
    refused = httpx.options(guarded + "/v1/chat/completions", headers={"Origin": "http://evil.example", **ask})
    assert refused.status_code == 400 and "access-control-allow-origin" not in refused.headers
    r = httpx.get(guarded + "/v1/models", headers={"Origin": ORIGIN, "Authorization": f"Bearer {KEY}"})
    assert r.headers["access-control-allow-origin"] == ORIGIN


def test_tokenize_detokenize_version_and_model_card(guarded):
    auth = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(guarded + "/tokenize", json={"model": "fake", "prompt": "héllo"}, headers=auth).json()
    assert r["tokens"] == [b + 3 for b in "héllo".encode()] and r["count"] == 6 and r["max_model_len"] == 2048
    chat = httpx.post(guarded + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]},
                      headers=auth).json()
    assert bytes(t - 3 for t in chat["tokens"]).decode().endswith("<|im_start|>assistant\n")
    back = httpx.post(guarded + "/detokenize", json={"tokens": r["tokens"]}, headers=auth).json()
    assert back == {"prompt": "héllo"}
    bad = httpx.post(guarded + "/detokenize", json={"tokens": [-1]}, headers=auth)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    both = httpx.post(guarded + "/tokenize", json={"prompt": "a", "messages": []}, headers=auth)
    assert both.status_code == 400
    assert httpx.get(guarded + "/version").json() == {"version": scratchllm.__version__}
    client = openai.OpenAI(base_url=guarded + "/v1", api_key=KEY, max_retries=0)
    assert client.models.retrieve("fake").id == "fake"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")


def _serve_args(argv):
    return build_parser().parse_args(["serve", *argv])


def test_environment_defaults_and_the_positional_model(monkeypatch):
    monkeypatch.setenv("SCRATCHLLM_MAX_NUM_SEQS", "5")
    monkeypatch.setenv("SCRATCHLLM_API_KEY", "from-env")
    monkeypatch.setenv("SCRATCHLLM_FAKE_ENGINE", "true")
    args = _serve_args(["some/model.gguf", "--max-num-seqs", "7"])
    assert args.max_num_seqs == 7 and args.api_key == "from-env" and args.fake_engine  # a flag wins
    assert args.model_arg == ["some/model.gguf"]
    assert _serve_args([]).max_num_seqs == 5
    monkeypatch.setenv("SCRATCHLLM_MAX_NUM_SEQS", "many")
    with pytest.raises(ConfigError, match="SCRATCHLLM_MAX_NUM_SEQS"):
        serve_cmd.build(_serve_args([]))
    monkeypatch.delenv("SCRATCHLLM_MAX_NUM_SEQS")
    # MODEL and --model add up: every model named is served (--replicas alone takes one)
    assert serve_cmd.models_from_args(_serve_args(["a.gguf", "-m", "b.gguf", "-m", "a.gguf"])) == ["a.gguf", "b.gguf"]
    with pytest.raises(ConfigError, match="two models"):
        serve_cmd.model_from_args(_serve_args(["a.gguf", "-m", "b.gguf"]))


def test_chat_template_override(tmp_path):
    from scratchllm.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained("default")
    path = tmp_path / "plain.jinja"
    path.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant]")
    other = serve_cmd._with_chat_template(tok, str(path))
    assert other.apply_chat_template([{"role": "user", "content": "hi"}]) == "[user] hi\n[assistant]"
    assert serve_cmd._with_chat_template(tok, "{{ messages[0].content }}!").apply_chat_template(
        [{"role": "user", "content": "x"}]) == "x!"
    with pytest.raises(ConfigError, match="chat-template"):
        serve_cmd._with_chat_template(tok, "{% for %}")


def test_kv_cache_memory_sizes_the_pool():
    """--kv-cache-memory takes sizes as people write them; the engine's pool gets that many bytes of
    whole blocks."""
    assert [serve_cmd.memory_size(t) for t in ("256MiB", "1.5GiB", "300MB", "4096")] == [
        256 * 2**20, 3 * 2**29, 300 * 10**6, 4096]
    for bad in ("12XB", "-5MiB", "0", "MiB"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", "--kv-cache-memory", bad])
    args = _serve_args(["default", "--kv-cache-memory", "24MiB", "--embedding-model", "none", "--trace", "none"])
    load = serve_cmd.build(args).specs[0].load
    model = load()
    try:
        plan = model.engine.engine.plan
        assert plan.num_kv_blocks == 24 * 2**20 // plan.kv_block_bytes
    finally:
        model.engine.shutdown()
