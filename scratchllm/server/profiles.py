"""What a model name of the user's adds to every request made through it (formats/names.py;
made by Ollama's /api/create and /api/copy, server/model_names.py): its sampling parameters (by
Ollama's option names), its system prompt, its earlier messages, its chat template. Applied to
the OpenAI request body, before it is parsed, on the OpenAI routes (generation.read_request) and
on Ollama's (which translate into that body), so both take the same additions; a request's own
fields win.
"""

from typing import Any

from scratchllm.formats import names
from scratchllm.server.ollama_protocol import openai_fields
from scratchllm.server.registry import ModelRegistry


def load_profiles(registry: ModelRegistry) -> None:
    """The served models that are names of the user's (`serve mybot`) add what those names add."""
    for name in registry.every_name():
        named = names.lookup(name)
        if named is not None and not named.adds_nothing():
            registry.profiles[name] = named


def profile_of(registry: ModelRegistry, name: Any) -> names.Named | None:
    """What the model name `name` adds (a name without a tag is `NAME:latest`), or None."""
    if not registry.profiles or not isinstance(name, str):
        return None
    return registry.profiles.get(name) or registry.profiles.get(names.canonical(name))


def with_profile(registry: ModelRegistry, body: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI request body (chat or completions) with what its model's name adds: the sampling
    fields it does not set, the name's system prompt when it has none, the name's messages
    before its own, the name's chat template. Unchanged for a name that adds nothing."""
    named = profile_of(registry, body.get("model"))
    if named is None:
        return body
    out = dict(body)
    for key, value in openai_fields(named.parameters, None).items():
        if key == "max_tokens" and ("max_completion_tokens" in out or "max_tokens" in out):
            continue
        if key != "num_ctx":
            out.setdefault(key, value)
    messages = out.get("messages")
    if isinstance(messages, list):
        lead = 0  # the request's own system messages stay first, in place of the name's
        while lead < len(messages) and isinstance(messages[lead], dict) and messages[lead].get("role") == "system":
            lead += 1
        system = [] if lead or named.system is None else [{"role": "system", "content": named.system}]
        out["messages"] = [*messages[:lead], *system, *named.messages, *messages[lead:]]
        if named.template is not None:
            out.setdefault("chat_template", named.template)
    return out
