"""The sandbox chat templates render in: Jinja2's immutable sandbox, tightened so that a
template can neither escape, read a file, run long nor build a huge value (tokenizer/chat.py
says how, and why). Its rewriting of a compiled template: every for-loop's iterable ticks the
deadline per item, every literal list, dict, tuple and `~` join is measured when made; its
overrides measure each operator's, call's and filter's result against the render's budget
(template_budget.py).

This module imports Jinja2: tokenizer/chat.py imports it on the first template, not with the
package.
"""

from collections.abc import Callable, Iterable
from datetime import datetime
from functools import lru_cache
from typing import Any, NoReturn

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from scratchllm.tokenizer.template_budget import (
    MAX_INT_BITS,
    ChatTemplateError,
    Ticking,
    bounded_filter,
    bounded_range,
    check_str_method,
    current_budget,
    format_chars,
    tojson,
)

REFUSED = {nodes.Include: "{% include %}", nodes.Import: "{% import %}", nodes.FromImport: "{% from ... import %}",
           nodes.Extends: "{% extends %}"}


def raise_exception(message: str) -> NoReturn:
    raise jinja2.exceptions.TemplateError(message)


def strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class TemplateSandbox(ImmutableSandboxedEnvironment):
    """Jinja2's immutable sandbox, tightened (see the module doc): includes refused at compile
    time, loops, calls, operators and attribute reads ticking the deadline, and every value made
    measured against the render's budget."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def _parse(self, source: str, name: str | None, filename: str | None) -> nodes.Template:
        tree = super()._parse(source, name, filename)
        for kind, tag in REFUSED.items():
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

    def ticking(self, iterable: Any) -> Ticking:
        return Ticking(iterable)

    def measured(self, value: object) -> object:
        return current_budget().check(value, "a literal")

    def joined(self, *parts: object) -> str:
        budget = current_budget()
        strings = [p if isinstance(p, str) else str(budget.check(p, "a joined value")) for p in parts]
        budget.allow(sum(map(len, strings)), "a '~' join")
        return "".join(strings)

    def bounded_concat(self, pieces: Iterable[str]) -> str:  # a block's, macro's or loop's text
        budget, out, n = current_budget(), [], 0
        for piece in pieces:
            n += len(piece)
            budget.allow(n, "a block's text")
            out.append(piece)
        return "".join(out)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        budget = current_budget()
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
            format_chars(budget, left, right if isinstance(right, tuple) else [right], "a '%' format")
        elif operator == "+" and isinstance(left, list | tuple) and type(left) is type(right):
            n = budget.size(left) + budget.size(right)  # known, without walking the result
            budget.allow(n, f"the result of '{operator}'")
            return budget.remember(super().call_binop(context, operator, left, right), n)
        return budget.check(super().call_binop(context, operator, left, right), f"the result of '{operator}'")

    def getattr(self, obj: Any, attribute: str) -> Any:
        current_budget().tick()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        current_budget().tick()
        return super().getitem(obj, argument)

    def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
        raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        wrapped = super().wrap_str_format(value)
        if wrapped is None:
            return None
        fmt: str = value.__self__

        def bounded(*args: Any, **kwargs: Any) -> str:
            budget = current_budget()
            values = [*args, *kwargs.values()]
            if value.__name__ == "format_map" and args and isinstance(args[0], dict):
                values = list(args[0].values())
            format_chars(budget, fmt, values, "str.format's result")
            return str(budget.check(wrapped(*args, **kwargs), "str.format's result"))

        return bounded

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        budget = current_budget()
        budget.tick()
        method = getattr(__obj, "__name__", None)
        if isinstance(getattr(__obj, "__self__", None), str) and isinstance(method, str):
            args = check_str_method(budget, method, __obj.__self__, args)
        return budget.check(super().call(__context, __obj, *args, **kwargs), "a call's result")


@lru_cache(maxsize=1)
def environment() -> TemplateSandbox:
    """The one sandbox, with Hugging Face transformers' settings and globals (trim_blocks,
    lstrip_blocks, loop controls, `raise_exception`, `strftime_now`, a `tojson` that keeps
    non-ASCII text), so that a template renders here as it does there."""
    # optimized=False: no constant folding, which tries every node of a chain of unary operators
    # (`a - - - ... b`) down to its end, quadratic in its length: 120 of them took 13 s to compile.
    env = TemplateSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols], optimized=False)
    env.concat = env.bounded_concat  # type: ignore[method-assign]
    for name in ("urlize", "pprint"):  # no chat template uses them; their output is hard to bound
        env.filters.pop(name, None)
    env.filters["tojson"] = tojson
    env.filters = {name: bounded_filter(name, f) for name, f in env.filters.items()}
    env.globals.pop("lipsum", None)
    env.globals["range"] = bounded_range
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env
