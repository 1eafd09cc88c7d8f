"""Chat templates: the Jinja2 program a model ships to turn a list of messages into its prompt.

Templates come from files we did not write (GGUF `tokenizer.chat_template`, tokenizer_config.json),
so they are hostile until rendered. They run in Jinja2's immutable sandbox (no attribute access to
Python internals, no mutation of the messages passed in), tightened so that a template can neither
escape, read a file, run long nor build a huge value:

- an unsafe attribute (`''.__class__`, `cycler.__init__`) is an error at once, not a silent
  undefined; `{% include %}`, `{% import %}` and `{% extends %}` are refused when the template is
  compiled (there is no file a template may read); `lipsum`, `urlize` and `pprint` are not there;
- every value the template makes (an operator's result, a literal list or dict, a `~` join, a
  call's or filter's result, a block's text) is measured: none may pass the size limit, and the
  few operations whose result can be far larger than their inputs (`*`, `**`, `%`, `format`,
  `replace`, `join`, `center`, `indent`, `wordwrap`, `tojson(indent=)` ...) are measured before
  they run, so no such value is ever allocated;
- a deadline is checked at every loop step, call, operator, attribute and output chunk, so a
  template that loops for long is stopped when its time is spent (in the rendering thread itself:
  nothing keeps running after the error);
- the output is counted chunk by chunk against the size limit.

The limits (TemplateLimits): 1 s and 1 MiB (characters) beyond twice the size of the messages and
tools passed in; SCRATCHLLM_CHAT_TEMPLATE_SECONDS and SCRATCHLLM_CHAT_TEMPLATE_MAX_CHARS change
them. Every refusal is a ChatTemplateError (a ConfigError) naming the problem.

The environment otherwise matches what Hugging Face transformers gives templates (trim_blocks,
lstrip_blocks, loop controls, `raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII
text), so a template renders here exactly as it does there.

Jinja2 is imported on the first template, not with the package: a process that only generates
from token ids (or plain text) never pays its ~7 MB.
"""

import contextvars
import json
import os
import re
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache, update_wrapper
from typing import TYPE_CHECKING, Any, NoReturn

from scratchllm.errors import ConfigError

if TYPE_CHECKING:
    import jinja2


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


class _Budget:
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


_BUDGET: contextvars.ContextVar[_Budget] = contextvars.ContextVar("chat_template_budget")


def _budget() -> _Budget:
    """The render in progress; outside one (constant folding while compiling), a fresh default."""
    budget = _BUDGET.get(None)
    return budget if budget is not None else _Budget(TemplateLimits())


def _is_namespace(value: object) -> bool:
    return type(value).__name__ == "Namespace" and type(value).__module__ == "jinja2.utils"


def _raise_exception(message: str) -> NoReturn:
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: object, ensure_ascii: bool = False, indent: int | str | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters ('<' -> '\u003c'), which would change prompts.
    width = len(indent) if isinstance(indent, str) else indent or 0
    if width > MAX_INDENT:
        raise ChatTemplateError(f"chat template refused: tojson indent {width} is past the limit of {MAX_INDENT}")
    if indent is None:  # the C encoder: at most 6 characters per input character
        return json.dumps(value, ensure_ascii=ensure_ascii, separators=separators, sort_keys=sort_keys)
    # Indented output grows with depth: encoded piece by piece, measured as it goes.
    budget, out, n = _budget(), [], 0
    encoder = json.JSONEncoder(ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    for piece in encoder.iterencode(value):
        n += len(piece)
        budget.allow(n, "tojson's text")
        budget.tick()
        out.append(piece)
    return "".join(out)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _bounded_range(*args: int) -> range:
    r = range(*args)
    if len(r) > MAX_RANGE:
        raise ChatTemplateError(f"chat template refused: range of {len(r)} items, past the limit of {MAX_RANGE}")
    return r


# ---- what an operation may make, measured before it runs ------------------------------------
_WIDTHS = re.compile(r"\d+")


def _format_chars(budget: _Budget, fmt: str, args: Iterable[object], what: str) -> None:
    """'%'-formatting and str.format: each field prints at most the largest argument, padded to at
    most the largest width written in the format or passed as an argument."""
    args = list(args)
    widest = max([int(w) for w in _WIDTHS.findall(fmt) if len(w) < 12] + [1])
    widest = max([widest, *(a for a in args if isinstance(a, int) and not isinstance(a, bool))])
    biggest = max([budget.size(a) for a in args] + [0])
    fields = fmt.count("%") + fmt.count("{")
    budget.allow(len(fmt) + fields * (biggest + widest), what)


def _join_chars(budget: _Budget, sep: str, items: list[object]) -> None:
    budget.allow(sum(budget.size(x) for x in items) + len(sep) * max(len(items) - 1, 0), "a joined string")


def _replace_chars(budget: _Budget, s: str, old: str, new: str) -> None:
    count = s.count(old) if old else len(s) + 1
    budget.allow(len(s) + count * len(new), "a replaced string")


def _int_arg(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _check_str_method(budget: _Budget, name: str, s: str, args: tuple[Any, ...]) -> tuple[Any, ...]:
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


def _bounded_filter(name: str, f: Callable[..., Any]) -> Callable[..., Any]:
    """The filter, with its result (and, where it can be far larger than its input, its inputs)
    measured against the render's budget."""
    # Filters marked pass_context / pass_eval_context / pass_environment take that first.
    skip = 1 if getattr(f, "jinja_pass_arg", None) is not None else 0

    def bounded(*args: Any, **kwargs: Any) -> Any:
        budget = _budget()
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
            _format_chars(budget, s, [*rest, *kwargs.values()], "format's result")
        elif name in ("batch", "slice"):
            budget.allow(budget.size(value) + _int_arg(arg(0, "linecount" if name == "batch" else "slices", 0)),
                         f"{name}'s result")
        elif name == "sum" and isinstance(kwargs.get("start", rest[1] if len(rest) > 1 else 0), list | tuple):
            return _sum_sequences(budget, value, arg(0, "attribute", None), arg(1, "start", []))
        return budget.check(f(*args, **kwargs), f"{name}'s result")

    return update_wrapper(bounded, f)


def _sum_sequences(budget: _Budget, items: Any, attribute: object, start: list[Any] | tuple[Any, ...]) -> Any:
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


class _Ticking:
    """A for-loop's iterable: the deadline is checked before each item."""

    def __init__(self, iterable: Any) -> None:
        self.iterable = iterable

    def __iter__(self) -> Iterator[Any]:
        budget = _budget()
        for item in self.iterable:
            budget.tick()
            yield item

    def __len__(self) -> int:
        return len(self.iterable)


@lru_cache(maxsize=1)
def _environment() -> "jinja2.Environment":
    import jinja2
    import jinja2.ext
    from jinja2 import nodes
    from jinja2.exceptions import SecurityError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    refused = {nodes.Include: "{% include %}", nodes.Import: "{% import %}", nodes.FromImport: "{% from ... import %}",
               nodes.Extends: "{% extends %}"}

    class Environment(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**", "+", "%"})

        def _parse(self, source: str, name: str | None, filename: str | None) -> nodes.Template:
            tree = super()._parse(source, name, filename)
            for kind, tag in refused.items():
                for node in tree.find_all(kind):
                    raise ChatTemplateError(f"chat template refused: line {node.lineno} uses {tag}, and a chat "
                                            f"template may not read other files")
            for node in tree.find_all(nodes.For):
                node.iter = self._helper("ticking", [node.iter], node.lineno)
            for parent in list(tree.find_all(nodes.Node)):  # literals and `~` joins, measured when made
                for field in parent.fields:
                    child = getattr(parent, field)
                    children = child if isinstance(child, list) else [child]
                    wrapped = [self._measured(c) for c in children]
                    if wrapped != children:
                        setattr(parent, field, wrapped if isinstance(child, list) else wrapped[0])
            tree.set_environment(self)
            return tree

        @staticmethod
        def _helper(name: str, args: list[Any], lineno: int) -> nodes.Call:
            """A call of environment.<name>(*args): what the rewritten template runs in a node's place."""
            return nodes.Call(nodes.EnvironmentAttribute(name, lineno=lineno), args, [], None, None, lineno=lineno)

        @classmethod
        def _measured(cls, node: Any) -> Any:
            if isinstance(node, nodes.Concat):
                return cls._helper("joined", node.nodes, node.lineno)
            if isinstance(node, nodes.List | nodes.Dict) or (isinstance(node, nodes.Tuple) and node.ctx == "load"):
                return cls._helper("measured", [node], node.lineno)
            return node

        def ticking(self, iterable: Any) -> _Ticking:
            return _Ticking(iterable)

        def measured(self, value: object) -> object:
            return _budget().check(value, "a literal")

        def joined(self, *parts: object) -> str:
            budget = _budget()
            strings = [p if isinstance(p, str) else str(budget.check(p, "a joined value")) for p in parts]
            budget.allow(sum(map(len, strings)), "a '~' join")
            return "".join(strings)

        def bounded_concat(self, pieces: Iterable[str]) -> str:  # a block's, macro's or loop's text
            budget, out, n = _budget(), [], 0
            for piece in pieces:
                n += len(piece)
                budget.allow(n, "a block's text")
                out.append(piece)
            return "".join(out)

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            budget = _budget()
            budget.tick()
            ints = all(isinstance(x, int) for x in (left, right))
            if operator == "**" and ints and abs(left) > 1 and right > 0:
                if right * left.bit_length() > MAX_INT_BITS:
                    raise ChatTemplateError(f"chat template refused: {left} ** {right} is past {MAX_INT_BITS} bits")
            elif operator == "*" and ints:
                if left.bit_length() + right.bit_length() > MAX_INT_BITS:
                    raise ChatTemplateError(f"chat template refused: a product past {MAX_INT_BITS} bits")
            elif operator == "*":
                seq, n = (left, right) if isinstance(right, int) else (right, left)
                if isinstance(n, int) and isinstance(seq, str | list | tuple):
                    budget.allow(budget.size(seq) * max(n, 0), f"a {type(seq).__name__} repeated {n} times")
            elif operator == "%" and isinstance(left, str):
                _format_chars(budget, left, right if isinstance(right, tuple) else [right], "a '%' format")
            elif operator == "+" and isinstance(left, list | tuple) and type(left) is type(right):
                n = budget.size(left) + budget.size(right)  # known, without walking the result
                budget.allow(n, f"the result of '{operator}'")
                return budget.remember(super().call_binop(context, operator, left, right), n)
            return budget.check(super().call_binop(context, operator, left, right), f"the result of '{operator}'")

        def getattr(self, obj: Any, attribute: str) -> Any:
            _budget().tick()
            return super().getattr(obj, attribute)

        def getitem(self, obj: Any, argument: Any) -> Any:
            _budget().tick()
            return super().getitem(obj, argument)

        def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
            raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")

        def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
            wrapped = super().wrap_str_format(value)
            if wrapped is None:
                return None
            fmt: str = value.__self__

            def bounded(*args: Any, **kwargs: Any) -> str:
                budget = _budget()
                values = [*args, *kwargs.values()]
                if value.__name__ == "format_map" and args and isinstance(args[0], dict):
                    values = list(args[0].values())
                _format_chars(budget, fmt, values, "str.format's result")
                return str(budget.check(wrapped(*args, **kwargs), "str.format's result"))

            return bounded

        def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
            budget = _budget()
            budget.tick()
            method = getattr(__obj, "__name__", None)
            if isinstance(getattr(__obj, "__self__", None), str) and isinstance(method, str):
                args = _check_str_method(budget, method, __obj.__self__, args)
            return budget.check(super().call(__context, __obj, *args, **kwargs), "a call's result")

    # optimized=False: no constant folding, which tries every node of a chain of unary operators
    # (`a - - - ... b`) down to its end, quadratic in its length: 120 of them took 13 s to compile.
    env = Environment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols], optimized=False)
    env.concat = env.bounded_concat  # type: ignore[method-assign]
    for name in ("urlize", "pprint"):  # no chat template uses them; their output is hard to bound
        env.filters.pop(name, None)
    env.filters["tojson"] = _tojson
    env.filters = {name: _bounded_filter(name, f) for name, f in env.filters.items()}
    env.globals.pop("lipsum", None)
    env.globals["range"] = _bounded_range
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@lru_cache(maxsize=16)
def compile_template(source: str) -> "jinja2.Template":
    import jinja2

    if not isinstance(source, str):
        raise ChatTemplateError(f"a chat template must be text, got {type(source).__name__}")
    token = _BUDGET.set(_Budget(TemplateLimits()))  # compiling folds constants: bounded too
    try:
        return _environment().from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template does not parse: {e}") from None
    except ChatTemplateError:
        raise
    except Exception as e:  # noqa: BLE001 - whatever compiling a hostile template raises is its fault
        raise ChatTemplateError(f"chat template does not compile: {type(e).__name__}: {e}") from None
    finally:
        _BUDGET.reset(token)


def render_chat(source: str, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
                special_tokens: dict[str, str] | None = None, limits: TemplateLimits | None = None,
                **extra: Any) -> str:
    """messages: [{"role": ..., "content": ...}, ...] -> the prompt text (not yet tokenized).

    special_tokens gives the template its variables bos_token, eos_token, ... as strings. The
    render is stopped past `limits` (default_limits()) with a ChatTemplateError.
    """
    for m in messages:
        if not isinstance(m, dict) or "role" not in m:
            raise ConfigError(f"a chat message must be a dict with a 'role', got {m!r}")
    import jinja2

    template = compile_template(source)
    variables: dict[str, Any] = dict(special_tokens or {})
    variables.update(extra)
    budget = _Budget(limits or default_limits())
    budget = _Budget(budget.limits, budget.size(messages) + budget.size(variables))
    token = _BUDGET.set(budget)
    try:
        out, n = [], 0
        for chunk in template.generate(messages=messages, add_generation_prompt=add_generation_prompt, **variables):
            n += len(chunk)
            budget.allow(n, "the rendered prompt")
            budget.tick()
            out.append(chunk)
        return "".join(out)
    except ChatTemplateError:
        raise
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"chat template refused the messages: {e}") from None
    except RecursionError:
        raise ChatTemplateError("chat template stopped: it recursed too deep") from None
    except Exception as e:  # noqa: BLE001 - a template's own failure (1/0, a bad operand) is its input's
        raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {e}") from None
    finally:
        _BUDGET.reset(token)
