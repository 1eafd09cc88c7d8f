"""What one chat template render may spend, and the measuring of what it makes.

A render's `Budget` (a deadline and a size limit) lives in a context variable while the render
runs; the sandbox (template_sandbox.py) and the filters wrapped here measure every value a
template makes against it, and the few operations whose result can be far larger than their
inputs (`*`, `%`, `format`, `replace`, `join`, `center`, `indent`, `wordwrap`, `tojson(indent=)`
...) before they run, so that no such value is ever allocated. The limits and why they are
what they are: tokenizer/chat.py.
"""

import contextvars
import json
import os
import re
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import update_wrapper
from typing import Any

from scratchllm.errors import ConfigError


class ChatTemplateError(ConfigError):
    """A chat template was refused or stopped: it does not parse, reaches for Python internals or
    files, runs past its time limit, or makes a value or an output past its size limit."""


@dataclass(frozen=True)
class TemplateLimits:
    """What one render may spend. max_chars is on top of twice the size of the inputs, so a long
    conversation always fits its own template."""

    seconds: float = 1.0
    max_chars: int = 1 << 20


MAX_INT_BITS = 4096  # the largest integer a template may make (no chat template needs more than 64)
MAX_RANGE = 100_000  # the longest range(), as in Jinja's own sandbox
MAX_INDENT = 64  # the widest tojson indent


def default_limits() -> TemplateLimits:
    """The limits in force: TemplateLimits' defaults, or the SCRATCHLLM_CHAT_TEMPLATE_* variables."""
    seconds, chars = (os.environ.get(f"SCRATCHLLM_CHAT_TEMPLATE_{k}") for k in ("SECONDS", "MAX_CHARS"))
    try:
        limits = TemplateLimits(float(seconds) if seconds else 1.0, int(chars) if chars else 1 << 20)
    except ValueError:
        raise ConfigError(f"SCRATCHLLM_CHAT_TEMPLATE_SECONDS / _MAX_CHARS must be numbers, got "
                          f"{seconds!r} / {chars!r}") from None
    if not (limits.seconds > 0 and limits.max_chars > 0):
        raise ConfigError(f"chat template limits must be positive, got {limits}")
    return limits


class Budget:
    """One render's deadline and size limit, and the sizes of the containers it has measured."""

    def __init__(self, limits: TemplateLimits, input_chars: int = 0) -> None:
        self.limits = limits
        self.deadline = time.monotonic() + limits.seconds
        self.max_chars = limits.max_chars + 2 * input_chars
        self._sizes: dict[int, tuple[object, int]] = {}  # id -> (the object, kept alive; its size)

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise ChatTemplateError(f"chat template stopped: it ran past its time limit of {self.limits.seconds:g} s")

    def allow(self, chars: int, what: str) -> None:
        if chars > self.max_chars:
            raise ChatTemplateError(f"chat template refused: {what} would be {chars} characters, past the "
                                    f"limit of {self.max_chars}")

    def size(self, value: object) -> int:
        """About how many characters `value` prints as (str() of a container prints its items)."""
        if isinstance(value, str | bytes):
            return len(value)
        if isinstance(value, bool) or value is None:
            return 5
        if isinstance(value, int):
            return value.bit_length() // 3 + 1
        if isinstance(value, float):
            return 24
        if _is_namespace(value):  # mutable ({% set ns.x = ... %}): measured afresh each time
            return self.size(object.__getattribute__(value, "_Namespace__attrs"))
        if not isinstance(value, list | tuple | dict | set | frozenset):
            return 16  # undefined, a macro, a generator, a range: their text is short
        known = self._sizes.get(id(value))
        if known is not None and known[0] is value:
            return known[1]
        if isinstance(value, dict):
            n = 2 + sum(self.size(k) + self.size(v) + 4 for k, v in value.items())
        else:
            n = 2 + sum(self.size(v) + 2 for v in value)
        self._sizes[id(value)] = (value, n)  # a template cannot change a list, tuple or dict
        return n

    def remember(self, value: object, size: int) -> object:
        self._sizes[id(value)] = (value, size)
        return value

    def check(self, value: object, what: str) -> object:
        self.allow(self.size(value), what)
        return value


BUDGET: contextvars.ContextVar[Budget] = contextvars.ContextVar("chat_template_budget")


def current_budget() -> Budget:
    """The render in progress; outside one (constant folding while compiling), a fresh default."""
    budget = BUDGET.get(None)
    return budget if budget is not None else Budget(TemplateLimits())


def _is_namespace(value: object) -> bool:
    return type(value).__name__ == "Namespace" and type(value).__module__ == "jinja2.utils"


def tojson(value: object, ensure_ascii: bool = False, indent: int | str | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters ('<' -> '\u003c'), which would change prompts.
    width = len(indent) if isinstance(indent, str) else indent or 0
    if width > MAX_INDENT:
        raise ChatTemplateError(f"chat template refused: tojson indent {width} is past the limit of {MAX_INDENT}")
    if indent is None:  # the C encoder: at most 6 characters per input character
        return json.dumps(value, ensure_ascii=ensure_ascii, separators=separators, sort_keys=sort_keys)
    # Indented output grows with depth: encoded piece by piece, measured as it goes.
    budget, out, n = current_budget(), [], 0
    encoder = json.JSONEncoder(ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    for piece in encoder.iterencode(value):
        n += len(piece)
        budget.allow(n, "tojson's text")
        budget.tick()
        out.append(piece)
    return "".join(out)


def bounded_range(*args: int) -> range:
    r = range(*args)
    if len(r) > MAX_RANGE:
        raise ChatTemplateError(f"chat template refused: range of {len(r)} items, past the limit of {MAX_RANGE}")
    return r


# ---- what an operation may make, measured before it runs ------------------------------------
_WIDTHS = re.compile(r"\d+")


def format_chars(budget: Budget, fmt: str, args: Iterable[object], what: str) -> None:
    """'%'-formatting and str.format: each field prints at most the largest argument, padded to at
    most the largest width written in the format or passed as an argument."""
    args = list(args)
    widest = max([int(w) for w in _WIDTHS.findall(fmt) if len(w) < 12] + [1])
    widest = max([widest, *(a for a in args if isinstance(a, int) and not isinstance(a, bool))])
    biggest = max([budget.size(a) for a in args] + [0])
    fields = fmt.count("%") + fmt.count("{")
    budget.allow(len(fmt) + fields * (biggest + widest), what)


def _join_chars(budget: Budget, sep: str, items: list[object]) -> None:
    budget.allow(sum(budget.size(x) for x in items) + len(sep) * max(len(items) - 1, 0), "a joined string")


def _replace_chars(budget: Budget, s: str, old: str, new: str) -> None:
    count = s.count(old) if old else len(s) + 1
    budget.allow(len(s) + count * len(new), "a replaced string")


def _int_arg(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def check_str_method(budget: Budget, name: str, s: str, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """A str method's result, bounded before it is made; returns the args (join's materialized)."""
    if name in ("center", "ljust", "rjust", "zfill") and args:
        budget.allow(max(len(s), _int_arg(args[0])), f"str.{name}'s result")
    elif name == "expandtabs":
        budget.allow(len(s) * max(_int_arg(args[0]) if args else 8, 1), "str.expandtabs' result")
    elif name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        _replace_chars(budget, s, args[0], args[1])
    elif name == "join" and args:
        items = list(args[0])
        _join_chars(budget, s, items)
        return (items, *args[1:])
    elif name == "translate" and args and isinstance(args[0], dict):
        budget.allow(len(s) * max([budget.size(v) for v in args[0].values()] + [1]), "str.translate's result")
    return args


def bounded_filter(name: str, f: Callable[..., Any]) -> Callable[..., Any]:
    """The filter, with its result (and, where it can be far larger than its input, its inputs)
    measured against the render's budget."""
    # Filters marked pass_context / pass_eval_context / pass_environment take that first.
    skip = 1 if getattr(f, "jinja_pass_arg", None) is not None else 0

    def bounded(*args: Any, **kwargs: Any) -> Any:
        budget = current_budget()
        budget.tick()
        value, rest = (args[skip], args[skip + 1:]) if len(args) > skip else (None, ())

        def arg(i: int, key: str, default: Any) -> Any:
            return rest[i] if len(rest) > i else kwargs.get(key, default)

        s = value if isinstance(value, str) else ""
        if name == "center":
            budget.allow(max(len(s), _int_arg(arg(0, "width", 80))), "center's result")
        elif name == "indent":
            width = arg(0, "width", 4)
            w = len(width) if isinstance(width, str) else _int_arg(width)
            budget.allow(len(s) + (s.count("\n") + 1) * w, "indent's result")
        elif name == "wordwrap":
            width, wrap = max(_int_arg(arg(0, "width", 79)), 1), arg(2, "wrapstring", None) or "\n"
            lines = 2 * len(s) // width + s.count("\n") + 1
            budget.allow(len(s) + lines * budget.size(wrap), "wordwrap's result")
        elif name == "replace" and isinstance(arg(0, "old", None), str) and isinstance(arg(1, "new", None), str):
            _replace_chars(budget, str(value), arg(0, "old", ""), arg(1, "new", ""))
        elif name == "join" and value is not None and not isinstance(value, str):
            items = list(value)
            _join_chars(budget, str(arg(0, "d", "")), items)
            args = (*args[:skip], items, *rest)
        elif name == "format":
            format_chars(budget, s, [*rest, *kwargs.values()], "format's result")
        elif name in ("batch", "slice"):
            budget.allow(budget.size(value) + _int_arg(arg(0, "linecount" if name == "batch" else "slices", 0)),
                         f"{name}'s result")
        elif name == "sum" and isinstance(kwargs.get("start", rest[1] if len(rest) > 1 else 0), list | tuple):
            return _sum_sequences(budget, value, arg(0, "attribute", None), arg(1, "start", []))
        return budget.check(f(*args, **kwargs), f"{name}'s result")

    return update_wrapper(bounded, f)


def _sum_sequences(budget: Budget, items: Any, attribute: object, start: list[Any] | tuple[Any, ...]) -> Any:
    """sum(start=[...]) adds lists one by one, which is quadratic: done here in linear time."""
    if attribute is not None:
        raise ChatTemplateError("chat template refused: sum(attribute=..., start=<a list>) is not supported")
    out, n = list(start), budget.size(start)
    for x in items:
        budget.tick()
        n += budget.size(x)
        budget.allow(n, "sum's result")
        out += x
    return out if isinstance(start, list) else tuple(out)


class Ticking:
    """A for-loop's iterable: the deadline is checked before each item."""

    def __init__(self, iterable: Any) -> None:
        self.iterable = iterable

    def __iter__(self) -> Iterator[Any]:
        budget = current_budget()
        for item in self.iterable:
            budget.tick()
            yield item

    def __len__(self) -> int:
        return len(self.iterable)
