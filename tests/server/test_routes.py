"""The route table (server/routes.py) is the one list of endpoints: the app registers exactly its
rows, /openapi.json documents the ones with bodies, the evaluation loop replays the ones marked
so, the API key guards every row but the keyless ones, and a row's error shape is what its
errors get. A new row is all it takes for a new endpoint to be served, documented and guarded."""

from typing import Any

from fastapi import Request
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient
from pydantic import BaseModel

from scratchllm.evaluate import sources
from scratchllm.server import routes
from scratchllm.server.anthropic_protocol import anthropic_error_body
from scratchllm.server.app import ServerConfig, create_app
from scratchllm.server.backend import fake_backend
from scratchllm.server.protocol import parse_body
from scratchllm.server.routes import Route

KEY = "sk-routes"
AUTH = {"Authorization": f"Bearer {KEY}"}
APP_OWN = {("/health", "GET"), ("/metrics", "GET"), ("/", "GET"), ("/assets/{name}", "GET")}  # not the API


def _client() -> TestClient:
    model, embedder = fake_backend(step_ms=0.5)
    return TestClient(create_app(model, embedder, ServerConfig(api_key=KEY)))


def _registered(app: Any) -> set[tuple[str, str]]:
    return {(r.path, m) for r in app.routes if isinstance(r, APIRoute) for m in r.methods}


def test_the_app_serves_exactly_the_rows_and_openapi_documents_them():
    with _client() as client:
        assert _registered(client.app) - APP_OWN == {(r.path, r.method) for r in routes.ROUTES}
        spec = client.get("/openapi.json").json()
    assert set(spec["paths"]) == {r.path for r in routes.ROUTES if r.in_schema} | {"/health", "/metrics"}
    for route in routes.ROUTES:
        if route.body is not None and route.in_schema:
            body = spec["paths"][route.path][route.method.lower()]["requestBody"]
            assert body["content"]["application/json"]["schema"] == {"$ref": f"#/components/schemas/"
                                                                             f"{route.body.__name__}"}


def test_the_evaluation_loop_replays_the_rows_marked_replay():
    assert sources.ENDPOINTS == ("/v1/completions", "/v1/chat/completions")
    assert sources.ENDPOINTS == tuple(r.path for r in routes.ROUTES if r.replay)


def test_the_key_guards_every_row_but_the_keyless_ones_in_the_rows_error_shape():
    with _client() as client:
        for route in routes.ROUTES:
            path = route.path.replace("{model_id}", "fake")
            r = client.request(route.method, path, json={})
            if route.keyless:
                assert r.status_code == 200, path
                continue
            assert r.status_code == 401, path  # /score, /rerank and /v2/rerank included
            if route.method == "HEAD":
                continue  # no body
            error = r.json()["error"]
            if route.errors is anthropic_error_body:  # Anthropic's clients read {"type": "error", "error": {...}}
                assert r.json()["type"] == "error" and error["type"] == "authentication_error"
                continue
            assert isinstance(error, str) if path.startswith("/api/") else error["code"] == "invalid_api_key"
        # paths no row has: under the API's prefixes, the key first (a probe learns nothing)
        assert client.get("/api/nothing").json() == {"error": "No API key provided: send 'Authorization: Bearer "
                                                              "<key>' (or 'x-api-key: <key>') with the key this "
                                                              "server was started with"}
        assert client.get("/v1/nothing").status_code == 401
        missing = client.get("/v1/nothing", headers=AUTH)
        assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found"
        assert client.get("/api/nothing", headers=AUTH).json() == {"error": "Not Found"}
        assert client.get("/health").status_code == 200


class EchoRequest(BaseModel):
    model: str
    word: str


async def echo(request: Request) -> dict[str, str]:
    return {"echo": parse_body(await request.body(), EchoRequest).word}


def _teapot(err: Any) -> dict[str, Any]:
    return {"teapot": err.message}


def test_one_row_serves_documents_guards_and_shapes_a_new_endpoint(monkeypatch):
    row = Route("POST", "/v1/echo", echo, EchoRequest, errors=_teapot)
    monkeypatch.setattr(routes, "ROUTES", (*routes.ROUTES, row))
    with _client() as client:
        assert client.post("/v1/echo", json={"model": "fake", "word": "hi"}).status_code == 401
        assert client.post("/v1/echo", json={"model": "fake", "word": "hi"}, headers=AUTH).json() == {"echo": "hi"}
        bad = client.post("/v1/echo", json={"model": "fake"}, headers=AUTH)
        assert bad.status_code == 400 and "word" in bad.json()["teapot"]
        spec = client.get("/openapi.json").json()
        assert spec["paths"]["/v1/echo"]["post"]["requestBody"]["content"]["application/json"]["schema"] == {
            "$ref": "#/components/schemas/EchoRequest"}
        assert "EchoRequest" in spec["components"]["schemas"]
