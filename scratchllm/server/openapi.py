"""/openapi.json with the generation endpoints' request bodies described.

The handlers read their bodies themselves (parse_body: the JSON guards, then the pydantic
models), so FastAPI cannot infer the bodies from their signatures. Each route is registered
with `openapi_extra` naming its model's JSON schema, and every model the schemas reference
goes into components/schemas, so generators (schemathesis) and client generators can build
bodies from /openapi.json alone.
"""

from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel

from scratchllm.server.protocol import ChatCompletionRequest, CompletionRequest, EmbeddingRequest
from scratchllm.server.rerank import RerankRequest, ScoreRequest
from scratchllm.server.responses_request import ResponsesRequest

REF = "#/components/schemas/{model}"
BODIES: dict[str, type[BaseModel]] = {
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/embeddings": EmbeddingRequest,
    "/v1/score": ScoreRequest,
    "/v1/rerank": RerankRequest,
    "/v1/responses": ResponsesRequest,
}


def request_body(model: type[BaseModel]) -> dict[str, Any]:
    """The route's `openapi_extra`: a required JSON body of `model`."""
    return {"requestBody": {"required": True, "content": {
        "application/json": {"schema": {"$ref": REF.format(model=model.__name__)}}}}}


def components() -> dict[str, Any]:
    """Every request model and the models they reference ($defs), by name."""
    out: dict[str, Any] = {}
    for model in BODIES.values():
        schema = model.model_json_schema(ref_template=REF)
        out.update(schema.pop("$defs", {}))
        out[model.__name__] = schema
    return out


def install(app: FastAPI) -> None:
    """Make app.openapi() add the request models to the generated document (built once)."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            spec = generate()
            spec.setdefault("components", {}).setdefault("schemas", {}).update(components())
            app.openapi_schema = spec
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented way to extend the schema
