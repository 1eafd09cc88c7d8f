"""The request fields that constrain the output's shape, and the grammar they compile to.

At most one constraint per request, from these sources:
  response_format     {"type": "json_object"} or {"type": "json_schema", "json_schema": {...}}
  structured_outputs  vLLM's: {"json": schema} | {"regex": str} | {"choice": [str]} |
                      {"grammar": Lark or GBNF} | {"json_object": true}, exactly one of them
  guided_json         a JSON schema (object or JSON text)   } vLLM's older spellings of the
  guided_regex        a regular expression                  } same (guided_decoding_backend
  guided_choice       a list of strings                     } is accepted: llguidance is the
  guided_grammar      a grammar, Lark or GBNF               } one backend here)
  grammar             llama.cpp's: a GBNF grammar (Lark is accepted too)
  tool_choice         "required", a named function, or allowed_tools in "required" mode: the
                      output is forced to be a call of one of those tools (chat only).
A grammar's syntax is told apart by its rules: GBNF defines them with `::=` (start rule
`root`), Lark with `:` (start rule `start`).
"""

import json
from dataclasses import dataclass, field
from typing import Any

from pydantic import Field

from scratchllm.errors import ConfigError
from scratchllm.server.errors import bad_request
from scratchllm.server.messages import AllowedToolsChoice, NamedToolChoice, ResponseFormat, Strict
from scratchllm.structured.grammar import CompiledGrammar, GrammarCompiler


@dataclass(frozen=True)
class ToolPlan:
    """What the tools of a chat request ask for.

    mode: "none" (no tools, or tool_choice "none"), "auto" (the model may call one, in its chat
    template's own format) or "forced" (the grammar makes the reply a call of one of `tools`).
    tools: [{"name", "parameters"}] the call may use (forced) or the template shows (auto)."""

    mode: str
    tools: list[dict[str, Any]] = field(default_factory=list)


class StructuredOutputs(Strict):
    """vLLM's `structured_outputs` object (its StructuredOutputsParams)."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # accepted, no effect: there is one backend, and its JSON has no free whitespace already
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    # refused unless neutral
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: Any = None

    def constraint(self) -> tuple[str, str, Any] | None:
        """(kind, field, value) of the one constraint given, or None for an object naming none."""
        where = "structured_outputs"
        for name, why in (("disable_additional_properties", "give the schema \"additionalProperties\": false"),
                          ("whitespace_pattern", "JSON is written without free whitespace"),
                          ("structural_tag", "structural tags are not supported")):
            if getattr(self, name) not in (None, False):
                raise bad_request(f"'{where}.{name}' is not supported: {why}", param=f"{where}.{name}",
                                  code="unsupported_parameter")
        found: list[tuple[str, str, Any]] = []
        if self.json_ is not None:
            found.append(("json_schema", f"{where}.json", (_schema(self.json_, f"{where}.json"), True)))
        if self.regex is not None:
            found.append(("regex", f"{where}.regex", self.regex))
        if self.choice is not None:
            found.append(("choice", f"{where}.choice", self.choice))
        if self.grammar is not None:
            found.append(("grammar", f"{where}.grammar", self.grammar))
        if self.json_object:
            found.append(("json_object", f"{where}.json_object", None))
        if len(found) > 1:
            raise bad_request(f"'{where}' takes one of json, regex, choice, grammar, json_object; got "
                              f"{', '.join(f[1].split('.')[1] for f in found)}", param=where)
        return found[0] if found else None


class StructuredFields(Strict):
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None  # accepted, no effect: llguidance is the one backend
    guided_whitespace_pattern: str | None = None  # refused unless null (constraint())
    grammar: str | None = None

    def tool_plan(self) -> ToolPlan:
        # Only a request that declares the fields has tools: on completions, "tools" would be an
        # unknown (extra) field holding raw JSON, not FunctionTool models.
        declared = type(self).model_fields
        tools = [t.spec() for t in (getattr(self, "tools", None) or [])] if "tools" in declared else []
        choice = getattr(self, "tool_choice", None) if "tool_choice" in declared else None
        if not tools:
            if choice not in (None, "none"):
                raise bad_request("'tool_choice' needs 'tools'", param="tool_choice")
            return ToolPlan("none")
        by_name = {t["name"]: t for t in tools}
        if len(by_name) < len(tools):
            raise bad_request("'tools' has two functions of the same name", param="tools")
        if choice == "none":
            return ToolPlan("none", tools)
        if choice is None or choice == "auto":
            return ToolPlan("auto", tools)
        if choice == "required":
            return ToolPlan("forced", tools)
        if isinstance(choice, NamedToolChoice):
            return ToolPlan("forced", [_tool(by_name, choice.function.name)])
        assert isinstance(choice, AllowedToolsChoice), choice
        names = [(t.get("function") or {}).get("name") if isinstance(t, dict) else None
                 for t in choice.allowed_tools.tools]
        allowed = [_tool(by_name, n) for n in names]
        if not allowed:
            raise bad_request("'tool_choice.allowed_tools.tools' is empty", param="tool_choice")
        return ToolPlan("forced" if choice.allowed_tools.mode == "required" else "auto", allowed)

    def constraint(self) -> tuple[str, str, Any] | None:
        """(kind, the field it came from, value) of the request's one constraint, or None."""
        found: list[tuple[str, str, Any]] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            found.append(("json_object", "response_format", None))
        elif rf is not None and rf.type == "json_schema":
            js = rf.json_schema
            assert js is not None, "ResponseFormat's validator requires json_schema for this type"
            found.append(("json_schema", "response_format", (js.schema_ or {}, bool(js.strict))))
        if self.guided_whitespace_pattern is not None:
            raise bad_request("'guided_whitespace_pattern' is not supported: JSON is written without free "
                              "whitespace", param="guided_whitespace_pattern", code="unsupported_parameter")
        if self.structured_outputs is not None:
            so = self.structured_outputs.constraint()
            if so is not None:
                found.append(so)
        if self.guided_json is not None:
            found.append(("json_schema", "guided_json", (_schema(self.guided_json, "guided_json"), True)))
        if self.guided_regex is not None:
            found.append(("regex", "guided_regex", self.guided_regex))
        if self.guided_choice is not None:
            found.append(("choice", "guided_choice", self.guided_choice))
        if self.guided_grammar is not None:
            found.append(("grammar", "guided_grammar", self.guided_grammar))
        if self.grammar is not None:
            found.append(("grammar", "grammar", self.grammar))
        plan = self.tool_plan()
        if plan.mode == "forced":
            found.append(("tool_call", "tool_choice", plan.tools))
        if len(found) > 1:
            raise bad_request(f"'{found[0][1]}' and '{found[1][1]}' both constrain the output; give one",
                              param=found[1][1])
        return found[0] if found else None

    def compiled_grammar(self, compiler: GrammarCompiler | None) -> CompiledGrammar | None:
        """The CompiledGrammar for the request's constraint (None without one); a constraint
        that does not compile is a 400 naming its field."""
        c = self.constraint()
        if c is None:
            return None
        kind, param, value = c
        if compiler is None:
            raise bad_request(f"'{param}': structured output is not available for this model", param=param,
                              code="unsupported_parameter")
        try:
            if kind == "json_object":
                return compiler.json_object()
            if kind == "json_schema":
                return compiler.json_schema(value[0], strict=value[1])
            if kind == "regex":
                return compiler.regex(value)
            if kind == "choice":
                return compiler.choice(value)
            if kind == "grammar":
                return compiler.grammar(value)
            return compiler.tool_call(value)
        except ConfigError as err:
            raise bad_request(f"'{param}': {err}", param=param) from None


def _tool(by_name: dict[str, dict[str, Any]], name: str | None) -> dict[str, Any]:
    if name is None or name not in by_name:  # None: an allowed tool that names no function
        raise bad_request(f"'tool_choice' names function {str(name)[:64]!r}, which is not in 'tools'",
                          param="tool_choice")
    return by_name[name]


def _schema(value: dict[str, Any] | str, param: str) -> Any:  # the parsed JSON; the compiler checks the schema
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (ValueError, RecursionError):
            raise bad_request(f"'{param}' is not valid JSON", param=param) from None
    return value
