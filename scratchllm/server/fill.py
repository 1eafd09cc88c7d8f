"""Fill-in-the-middle for the endpoints that take it: OpenAI's `suffix` on /v1/completions,
Ollama's `suffix` on /api/generate and llama.cpp's /infill (infill.py). Each builds its prompt
here, in the served model's own layout (tokenizer/fim.py), and ends the middle at the tokens
that layout ends it with (Qwen2.5-Coder's <|endoftext|>, which is not its chat EOS), added to
the request's stop tokens. A model without fill-in-the-middle tokens is a 400 naming what its
file lacks, `param` being the field that asked for it.
"""

import dataclasses
from collections.abc import Sequence
from typing import cast

from scratchllm.sampling import SamplingParams
from scratchllm.server.errors import bad_request
from scratchllm.server.state import ServerState
from scratchllm.tokenizer.fim import FimLayout, FimTokenizer, FimUnsupported, RepoFile

# The names llama.cpp's server writes for the repository and the file being edited (its /infill
# has no field for either): the same request then makes the same prompt on both servers.
REPO_NAME = "myproject"
CURRENT_FILE = "filename"


def fim_layout(state: ServerState, param: str) -> FimLayout:
    """The served model's layout, or a 400 naming what it lacks."""
    find = getattr(state.model.tokenizer, "fim_layout", None)
    try:
        if find is None:
            raise FimUnsupported("this model's tokenizer has no fill-in-the-middle tokens")
        layout: FimLayout = find()
    except FimUnsupported as err:
        raise bad_request(f"'{param}' needs a fill-in-the-middle model: {err}", param=param,
                          code="unsupported_parameter") from None
    return layout


def fim_prompt_ids(state: ServerState, layout: FimLayout, prefix: str, suffix: str,
                   files: Sequence[RepoFile] = (), param: str = "suffix") -> list[int]:
    """The prompt's ids: `prefix` and `suffix` around the insertion point, `files` before them as
    the layout's repository context (a 400 naming `input_extra` where the layout has none)."""
    tok = cast(FimTokenizer, state.model.tokenizer)  # one with a fim_layout (fim_layout above) is one
    try:
        ids = layout.prompt_ids(tok, prefix, suffix, files, REPO_NAME, CURRENT_FILE)
    except FimUnsupported as err:
        raise bad_request(f"'input_extra' cannot be laid out: {err}; send it empty", param="input_extra",
                          code="unsupported_parameter") from None
    vocab = state.model.tokenizer.vocab_size
    if any(not 0 <= t < vocab for t in ids):
        raise bad_request(f"'{param}' has token ids outside [0, {vocab})", param=param)
    return ids


def ending_middle(params: SamplingParams, layout: FimLayout) -> SamplingParams:
    """`params` with the layout's end tokens among its stop tokens (unless ignore_eos)."""
    if params.ignore_eos:
        return params
    extra = tuple(t for t in layout.end_ids if t not in params.stop_token_ids)
    return dataclasses.replace(params, stop_token_ids=params.stop_token_ids + extra)
