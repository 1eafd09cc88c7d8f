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

Where each part lives: the sandbox in template_sandbox.py, the budget and the measuring of
what a template makes in template_budget.py; here, compiling and rendering. Jinja2 is imported
on the first template (template_sandbox.py), not with the package: a process that only
generates from token ids (or plain text) never pays its ~7 MB.
"""

from functools import lru_cache
from typing import TYPE_CHECKING, Any

from scratchllm.errors import ConfigError
from scratchllm.tokenizer.template_budget import BUDGET, Budget, ChatTemplateError, TemplateLimits, default_limits

if TYPE_CHECKING:
    import jinja2

__all__ = ["ChatTemplateError", "TemplateLimits", "compile_template", "default_limits", "render_chat"]


@lru_cache(maxsize=16)
def compile_template(source: str) -> "jinja2.Template":
    import jinja2

    from scratchllm.tokenizer.template_sandbox import environment

    if not isinstance(source, str):
        raise ChatTemplateError(f"a chat template must be text, got {type(source).__name__}")
    token = BUDGET.set(Budget(TemplateLimits()))  # compiling folds constants: bounded too
    try:
        return environment().from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template does not parse: {e}") from None
    except ChatTemplateError:
        raise
    except Exception as e:  # noqa: BLE001 - whatever compiling a hostile template raises is its fault
        raise ChatTemplateError(f"chat template does not compile: {type(e).__name__}: {e}") from None
    finally:
        BUDGET.reset(token)


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
    budget = Budget(limits or default_limits())
    budget = Budget(budget.limits, budget.size(messages) + budget.size(variables))
    token = BUDGET.set(budget)
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
        BUDGET.reset(token)
