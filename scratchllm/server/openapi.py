"""/openapi.json with the generation endpoints' request bodies described.

The handlers read their bodies themselves (parse_body: the JSON guards, then the pydantic
models), so FastAPI cannot infer the bodies from their signatures. Each route whose row in the
route table (server/routes.py) names a body model is registered with `openapi_extra` naming its
model's JSON schema, and every model the schemas reference goes into components/schemas, so
generators (schemathesis) and client generators can build bodies from /openapi.json alone.
"""

from collections.abc import Iterable
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel

REF = "#/components/schemas/{model}"


def request_body(model: type[BaseModel]) -> dict[str, Any]:
    """The route's `openapi_extra`: a required JSON body of `model`."""
    return {"requestBody": {"required": True, "content": {
        "application/json": {"schema": {"$ref": REF.format(model=model.__name__)}}}}}


def components(bodies: Iterable[type[BaseModel]]) -> dict[str, Any]:
    """Every request model and the models they reference ($defs), by name."""
    out: dict[str, Any] = {}
    for model in bodies:
        schema = model.model_json_schema(ref_template=REF)
        out.update(schema.pop("$defs", {}))
        out[model.__name__] = schema
    return out


def install(app: FastAPI, bodies: Iterable[type[BaseModel]]) -> None:
    """Make app.openapi() add the request models `bodies` to the generated document (built once)."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            spec = generate()
            spec.setdefault("components", {}).setdefault("schemas", {}).update(components(bodies))
            app.openapi_schema = spec
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented way to extend the schema
