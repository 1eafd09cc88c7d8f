"""schemathesis against the server's own /openapi.json, over the fake engine: bodies generated
from the declared request models, valid (positive) and invalid (negative). No response is a
5xx, and every error is an OpenAI error body. Examples are bounded to keep this in seconds."""

import json

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from scratchllm.server.app import ServerConfig, create_app
from scratchllm.server.backend import fake_backend

EXAMPLES = 60  # per operation and mode
# the extension endpoints' bodies are simpler (score, rerank) or end in the chat pipeline the chat
# route already covers (responses): fewer examples keep the suite's time
FEWER = {"/v1/score": 25, "/v1/rerank": 25, "/v1/responses": 25}


@pytest.fixture(scope="module")
def api(serve_module):
    # step_ms=0: a valid body may ask for the whole context; the fake then writes it at once
    model, embedder = fake_backend(max_model_len=512, step_ms=0.0, max_running=16)
    app = create_app(model, embedder, ServerConfig(max_in_flight=64, max_body_bytes=64 * 1024))
    with serve_module(app) as url:
        yield url, schemathesis.openapi.from_url(url + "/openapi.json"), app


def check_response(status: int, text: str) -> None:
    assert status < 500, f"{status}: {text[:500]}"
    if status >= 400:
        err = json.loads(text)["error"]
        assert set(err) == {"message", "type", "param", "code"}, err
        assert isinstance(err["message"], str) and err["message"]


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=["valid", "invalid"])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/score",
                                  "/v1/rerank", "/v1/responses"])
def test_generated_bodies_never_get_a_5xx(api, path, mode):
    url, schema, app = api
    operation = schema[path]["POST"]
    statuses: list[int] = []
    embedding = path in ("/v1/embeddings", "/v1/score", "/v1/rerank")
    served = "fake-embed" if embedding else "fake"

    @settings(max_examples=FEWER.get(path, EXAMPLES), deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case):
        if mode == GenerationMode.POSITIVE and isinstance(case.body, dict):
            case.body["model"] = served  # any other name is a 404, which would stop every body there
        response = case.call(base_url=url, timeout=30)
        statuses.append(response.status_code)
        check_response(response.status_code, response.text)

    run()
    assert statuses and all(s < 500 for s in statuses)
    if mode == GenerationMode.POSITIVE and not embedding:
        assert 200 in statuses, statuses  # valid bodies do reach the engine
    with httpx.Client(base_url=url) as c:
        assert c.get("/health").json()["status"] == "ok"
    assert app.state.server.metrics.in_flight == 0
