"""50 small, varied JSON schemas for structured output (tests and `bench structured`): nested objects,
arrays, enums, bounded numbers, required and optional fields, anyOf and nullables. Sizes are bounded
(maxLength, maxItems) so a greedy output always completes within the tests' max_tokens."""

from typing import Any

import numpy as np

NAMES = ["name", "city", "title", "color", "id", "count", "score", "price", "active", "tags", "items",
         "owner", "level", "kind", "notes", "size", "rank", "unit", "code", "year"]


def _leaf(rng: np.random.Generator, depth: int) -> dict[str, Any]:
    kinds = ["string", "integer", "number", "boolean", "enum", "int_array", "str_array", "nullable", "const",
             "pattern"]
    if depth < 2:
        kinds += ["object", "object_array", "any_of"]
    kind = kinds[int(rng.integers(len(kinds)))]
    lo = int(rng.integers(-50, 50))
    if kind == "string":
        return {"type": "string", "minLength": 1, "maxLength": int(rng.integers(3, 12))}
    if kind == "integer":
        return {"type": "integer", "minimum": lo, "maximum": lo + int(rng.integers(1, 1000))}
    if kind == "number":
        return {"type": "number", "minimum": float(lo), "maximum": float(lo + int(rng.integers(1, 100)))}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": ["red", "green", "blue", "small", "large"][: int(rng.integers(2, 6))]}
    if kind == "int_array":
        return {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99},
                "minItems": 1, "maxItems": int(rng.integers(1, 4))}
    if kind == "str_array":
        return {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": int(rng.integers(1, 4))}
    if kind == "nullable":
        return {"type": ["integer", "null"], "minimum": 0, "maximum": 9}
    if kind == "const":
        return {"const": "v1"}
    if kind == "pattern":
        return {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}
    if kind == "object":
        return object_schema(rng, depth + 1, int(rng.integers(1, 3)))
    if kind == "object_array":
        return {"type": "array", "items": object_schema(rng, depth + 1, 2), "minItems": 1, "maxItems": 2}
    return {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 5}, {"type": "string", "maxLength": 5}]}


def object_schema(rng: np.random.Generator, depth: int, n_fields: int) -> dict[str, Any]:
    names = list(rng.choice(NAMES, size=n_fields, replace=False))
    props = {str(n): _leaf(rng, depth) for n in names}
    required = [n for n in props if rng.random() < 0.7] or [next(iter(props))]
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


def schemas(n: int = 50, seed: int = 12) -> list[dict[str, Any]]:
    rng = np.random.default_rng(seed)
    out = [object_schema(rng, 0, int(rng.integers(1, 5))) for _ in range(n - 2)]
    # two top-level non-objects: a JSON schema need not describe an object
    out.append({"type": "array", "items": {"enum": ["yes", "no"]}, "minItems": 2, "maxItems": 3})
    out.append({"type": "integer", "minimum": 1900, "maximum": 2100})
    return out
