"""Grammars for structured output, compiled once per request against our tokenizer.

Every constraint a client can ask for becomes one llguidance grammar:

  json_object()                       any JSON object (OpenAI's JSON mode)
  json_schema(schema, strict)         a JSON value that validates against `schema`
  regex(pattern)                      text matching a regular expression (Rust regex syntax)
  choice(options)                     exactly one of the given strings
  grammar(text, syntax)               a context-free grammar: Lark (llguidance's dialect, start
                                      rule `start`) or llama.cpp's GBNF (start rule `root`),
                                      converted to Lark by llguidance's own gbnf_to_lark
  tool_call(tools)                    {"name": <one tool>, "arguments": <its parameters schema>}

JSON is written compactly with json.dumps' default separators (", " and ": ") and no other
whitespace: a small model given free whitespace tends to loop on newlines until max_tokens.
A grammar that llguidance rejects (a bad regex, an unsupported schema keyword under strict)
raises ConfigError here, before the request is admitted, so the client gets a 400 naming it.
"""

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from scratchllm.errors import ConfigError

if TYPE_CHECKING:
    import llguidance
    from llguidance._lib import JsonCompileOptions  # the type of grammar_from_json_schema's options

    from scratchllm.structured.matcher import GrammarMatcher
    from scratchllm.tokenizer.protocol import TokenizerLike

JSON_OPTIONS: "JsonCompileOptions" = {
    "whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


GRAMMAR_SYNTAXES = ("auto", "lark", "gbnf")


@dataclass(frozen=True, eq=False)
class CompiledGrammar:
    """A validated llguidance grammar bound to one tokenizer; SamplingParams.grammar holds it."""

    kind: str  # "json_object" | "json_schema" | "regex" | "choice" | "grammar" | "tool_call"
    grammar: str  # llguidance's serialized grammar
    lltokenizer: "llguidance.LLTokenizer"
    vocab_size: int
    eos_token_id: int

    def new_matcher(self) -> "GrammarMatcher":
        """A fresh per-request matcher at the grammar's start (scratchllm.structured.matcher)."""
        from scratchllm.structured.matcher import GrammarMatcher

        return GrammarMatcher(self)

    def __repr__(self) -> str:
        return f"CompiledGrammar({self.kind}, {len(self.grammar)} chars)"


class GrammarCompiler:
    """Compiles constraints for one tokenizer (its llguidance trie is built on first use)."""

    def __init__(self, tokenizer: "TokenizerLike") -> None:
        self.tokenizer = tokenizer

    def _compile(self, kind: str, grammar: str, what: str) -> CompiledGrammar:
        import llguidance

        from scratchllm.tokenizer.guidance import llg_tokenizer

        lltok = llg_tokenizer(self.tokenizer)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, lltok)
        if is_error:
            raise ConfigError(f"{what} cannot be compiled: {messages[0].strip()}")
        eos = self.tokenizer.eos_token_id
        assert eos is not None, "llg_tokenizer refuses a tokenizer without an end-of-sequence token"
        return CompiledGrammar(kind, grammar, lltok, self.tokenizer.vocab_size, eos)

    def json_object(self) -> CompiledGrammar:
        return self.json_schema({"type": "object"}, strict=False, kind="json_object")

    def json_schema(self, schema: object, strict: bool = True, kind: str = "json_schema") -> CompiledGrammar:
        """strict: a keyword llguidance cannot enforce is an error; otherwise it is ignored."""
        import llguidance

        if isinstance(schema, bool):  # true/false are valid JSON Schemas
            schema = {} if schema else {"not": {}}
        if not isinstance(schema, dict):
            raise ConfigError(f"a JSON schema must be an object, got {type(schema).__name__}")
        overrides: JsonCompileOptions = {**JSON_OPTIONS, "lenient": not strict}
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=overrides)
        except (ValueError, TypeError) as err:
            raise ConfigError(f"the JSON schema is not valid: {err}") from None
        return self._compile(kind, grammar, "the JSON schema")

    def regex(self, pattern: str) -> CompiledGrammar:
        import llguidance

        if not isinstance(pattern, str) or not pattern:
            raise ConfigError("a regex constraint must be a non-empty string")
        return self._compile("regex", llguidance.LLMatcher.grammar_from_regex(pattern), "the regex")

    def choice(self, options: object) -> CompiledGrammar:
        import llguidance

        if not (isinstance(options, (list, tuple)) and options and all(isinstance(o, str) and o for o in options)):
            raise ConfigError("a choice constraint must be a non-empty list of non-empty strings")
        # Lark string literals are JSON-escaped strings, so json.dumps quotes each option safely.
        lark = "start: " + " | ".join(json.dumps(o) for o in options)
        return self._compile("choice", llguidance.LLMatcher.grammar_from_lark(lark), "the choice list")

    def grammar(self, text: str, syntax: str = "auto") -> CompiledGrammar:
        """syntax: "lark", "gbnf", or "auto" (GBNF when the text defines its rules with `::=`)."""
        import llguidance
        from llguidance.gbnf_to_lark import GbnfToLarkError, gbnf_to_lark, is_lark_syntax

        if not isinstance(text, str) or not text.strip():
            raise ConfigError("a grammar must be a non-empty string")
        if syntax not in GRAMMAR_SYNTAXES:
            raise ConfigError(f"grammar syntax must be one of {', '.join(GRAMMAR_SYNTAXES)}, got {syntax!r}")
        if syntax == "gbnf" or (syntax == "auto" and not is_lark_syntax(text)):
            try:
                text = gbnf_to_lark(text)
            except (GbnfToLarkError, ValueError, KeyError, IndexError) as err:
                raise ConfigError(f"the GBNF grammar cannot be read: {err}") from None
        return self._compile("grammar", llguidance.LLMatcher.grammar_from_lark(text), "the grammar")

    def tool_call(self, tools: list[dict[str, Any]]) -> CompiledGrammar:
        """tools: [{"name": str, "parameters": JSON schema}] -> one call to one of them."""
        if not tools:
            raise ConfigError("a forced tool call needs at least one tool")
        options = [tool_call_schema(t["name"], t.get("parameters") or {"type": "object"}) for t in tools]
        schema = options[0] if len(options) == 1 else {"anyOf": options}
        return self.json_schema(schema, strict=True, kind="tool_call")


def tool_call_schema(name: str, parameters: dict[str, Any]) -> dict[str, Any]:
    """The JSON a forced call is written as: the function's name, then arguments that validate."""
    return {"type": "object", "properties": {"name": {"const": name}, "arguments": parameters},
            "required": ["name", "arguments"], "additionalProperties": False}
