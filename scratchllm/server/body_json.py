"""Request bytes -> JSON, refusing what Python's json module would let through or choke on.

json.loads alone is not enough for a server: it raises RecursionError (not a JSONDecodeError)
on deeply nested input, accepts escapes of unpaired surrogates ("\\ud800") that later fail to
encode as UTF-8 deep inside tokenization, reads 1e400 as inf and accepts NaN/Infinity, and
raises ValueError past 4300 digits of an integer. Each of these is a BodyError here, which
the caller turns into a 400, so no request body can reach the handlers in a shape that makes
them fail with a 500.
"""

import json
import math
from typing import Any, NoReturn

MAX_DEPTH = 64  # no field of the API nests deeper than a JSON schema does; 64 is generous
MAX_INT_DIGITS = 20  # int64 needs 19; nothing in the API means anything past that


class BodyError(ValueError):
    def __init__(self, message: str, code: str = "invalid_json"):
        super().__init__(message)
        self.code = code


def _int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise BodyError(f"number {text[:24]}... has more than {MAX_INT_DIGITS} digits", code="invalid_value")
    return int(text)


def _float(text: str) -> float:
    x = float(text)
    if not math.isfinite(x):
        raise BodyError(f"number {text[:24]} is out of range for a double", code="invalid_value")
    return x


def _constant(name: str) -> NoReturn:
    raise BodyError(f"{name} is not JSON (RFC 8259 has no NaN or Infinity)")


def load_body(raw: bytes) -> dict[str, Any]:
    """bytes -> the body's JSON object; BodyError naming the first problem."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise BodyError(f"request body is not valid UTF-8 (byte {err.start})", code="invalid_utf8") from None
    try:
        data = json.loads(text, parse_int=_int, parse_float=_float, parse_constant=_constant)
    except BodyError:
        raise
    except json.JSONDecodeError as err:
        raise BodyError(f"request body is not valid JSON: {err.msg} at line {err.lineno} column {err.colno}") from None
    except RecursionError:
        raise BodyError(f"request body is nested more than {MAX_DEPTH} levels deep") from None
    except ValueError as err:  # e.g. int() past sys.get_int_max_str_digits before our hook sees it
        raise BodyError(f"request body has an unreadable value: {str(err)[:120]}") from None
    if not isinstance(data, dict):
        raise BodyError("request body must be a JSON object")
    _check_tree(data)
    return data


def _check_tree(data: object) -> None:
    """Depth and text checks over the whole value, iteratively (no recursion to exhaust)."""
    stack: list[tuple[object, int]] = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise BodyError(f"request body is nested more than {MAX_DEPTH} levels deep")
        if isinstance(value, dict):
            for k, v in value.items():
                _check_text(k)
                stack.append((v, depth + 1))
        elif isinstance(value, list):
            stack.extend((v, depth + 1) for v in value)
        elif isinstance(value, str):
            _check_text(value)


def _check_text(s: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as err:
        raise BodyError(f"a string holds an unpaired surrogate (\\u{ord(s[err.start]):04x}); "
                        "JSON text must be valid Unicode", code="invalid_unicode") from None
