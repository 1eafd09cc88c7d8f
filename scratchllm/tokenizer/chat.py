"""Chat templates: the Jinja2 program a model ships to turn a list of messages into its prompt.

Templates come from files we did not write (GGUF `tokenizer.chat_template`, tokenizer_config.json),
so they run in Jinja2's immutable sandbox: no attribute access to Python internals, no mutation of
the messages passed in. The environment matches what Hugging Face transformers gives templates
(trim_blocks, lstrip_blocks, loop controls, `raise_exception`, `strftime_now`, a `tojson` that
keeps non-ASCII text), so a template renders here exactly as it does there.

Jinja2 is imported on the first template, not with the package: a process that only generates
from token ids (or plain text) never pays its ~7 MB.
"""

import json
from datetime import datetime
from functools import lru_cache
from typing import TYPE_CHECKING, Any, NoReturn

from scratchllm.errors import ConfigError

if TYPE_CHECKING:
    import jinja2


def _raise_exception(message: str) -> NoReturn:
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: object, ensure_ascii: bool = False, indent: int | str | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters ('<' -> '\u003c'), which would change prompts.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def compile_template(source: str) -> "jinja2.Template":
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ConfigError(f"chat template does not parse: {e}") from None


def render_chat(source: str, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
                special_tokens: dict[str, str] | None = None, **extra: Any) -> str:
    """messages: [{"role": ..., "content": ...}, ...] -> the prompt text (not yet tokenized).

    special_tokens gives the template its variables bos_token, eos_token, ... as strings.
    """
    for m in messages:
        if not isinstance(m, dict) or "role" not in m:
            raise ConfigError(f"a chat message must be a dict with a 'role', got {m!r}")
    import jinja2

    variables = dict(special_tokens or {})
    variables.update(extra)
    try:
        return compile_template(source).render(
            messages=messages, add_generation_prompt=add_generation_prompt, **variables
        )
    except jinja2.TemplateError as e:
        raise ConfigError(f"chat template refused the messages: {e}") from None
