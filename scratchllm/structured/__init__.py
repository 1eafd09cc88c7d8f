"""Structured output: grammars (JSON schema, regex, choice, forced tool calls) as token masks.

    compiler = GrammarCompiler(tokenizer)
    params = SamplingParams(temperature=0, grammar=compiler.json_schema(schema))

The sampler (scratchllm/engine/sampler.py) finds each request's matcher with `guide_for(request)`,
masks the request's logits with it and consumes the token it samples.
"""

import weakref
from collections.abc import Sequence
from typing import Protocol

from scratchllm.structured.grammar import CompiledGrammar, GrammarCompiler, tool_call_schema
from scratchllm.structured.matcher import GrammarMatcher, apply_mask
from scratchllm.structured.tools import ToolCallStream, tool_calls_from_text


class GrammarParams(Protocol):
    """What guide_for reads of a request's sampling parameters (SamplingParams has it)."""

    @property
    def grammar(self) -> CompiledGrammar | None: ...


class GuidedRequest(Protocol):
    """What guide_for needs of a request (the engine's Request): its params and its output so far."""

    @property
    def params(self) -> GrammarParams: ...

    @property
    def output_token_ids(self) -> Sequence[int]: ...


# One matcher per live request, keyed by the request object itself: it goes when the request does.
_matchers: "weakref.WeakKeyDictionary[GuidedRequest, GrammarMatcher]" = weakref.WeakKeyDictionary()


def guide_for(req: GuidedRequest) -> GrammarMatcher | None:
    """The request's matcher, in step with its output (None when it has no grammar).

    Call it when the request is added (so the first mask is computed during the prefill) and
    before each sample; it creates the matcher on first use and catches up on any output it
    has not consumed yet."""
    grammar = req.params.grammar
    if grammar is None:
        return None
    m = _matchers.get(req)
    if m is None:
        m = _matchers[req] = grammar.new_matcher()
    m.sync(req.output_token_ids)
    return m


__all__ = ["CompiledGrammar", "GrammarCompiler", "GrammarMatcher", "ToolCallStream", "apply_mask", "guide_for",
           "tool_call_schema", "tool_calls_from_text"]
