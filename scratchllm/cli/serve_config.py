"""Where `scratchllm serve` takes each option from: a TOML file, the environment, the command line.

Order, lowest first; each one given overrides the ones before it:
    1. the option's default (as --help shows it)
    2. the config file: `--config FILE.toml` (or SCRATCHLLM_CONFIG)
    3. SCRATCHLLM_<OPTION> environment variables (--max-num-seqs from SCRATCHLLM_MAX_NUM_SEQS)
    4. flags on the command line

The file holds any of serve's options by their long name without the dashes, in TOML's types:

    models = ["default", "minilm", "gemma3-270m"]   # or model = "default"
    port = 8080
    keep-alive = "5m"
    kv-cache-memory = "256MiB"                      # a size as the flag takes it, or a number of bytes
    lenient-fields = true

`max_num_seqs` is read as `max-num-seqs`. A key that is not an option, or a value of the wrong
type (a string where a number belongs, a choice the option does not offer), is refused at start
with the file and the key named. `serve --print-config` prints the options in effect, each with
where it came from, as a file that `--config` reads back (--api-key and --capture-key only as
set or not: a printed config is often pasted where a secret should not be).
"""

from __future__ import annotations

import argparse
import difflib
import json
import math
import os
import tomllib
from collections.abc import Callable
from typing import Any

from scratchllm.errors import ConfigError

ENV_PREFIX = "SCRATCHLLM_"
CONFIG_ENV = "SCRATCHLLM_CONFIG"
GIVEN = "_given_options"  # the namespace attribute: dests set by a flag on the command line
NOT_IN_FILE = {"help", "config", "print_config"}
SECRETS = {"api-key", "capture-key"}  # --print-config says they are set, never what they are
MODELS_KEYS = ("models", "model")  # the keys a file names its models by (both read as the model list)
MODELS_DESTS = ("model_arg", "model")  # the positional MODEL... and --model


def long_options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Each option's file key (its first long name without the dashes) -> its action."""
    return {longs[0][2:]: a for a in parser._actions
            if (longs := [o for o in a.option_strings if o.startswith("--")])}


def track_given(parser: argparse.ArgumentParser) -> None:
    """Make every option and positional of `parser` record, when the command line gives it, its
    dest in the namespace's GIVEN set: a flag equal to its default still overrides the file."""
    for action in parser._actions:
        if action.dest in (argparse.SUPPRESS, "help"):
            continue
        base = type(action)

        def call(self: argparse.Action, p: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None, _base: Any = base) -> None:
            _base.__call__(self, p, namespace, values, option_string)
            if self.option_strings or values not in (None, []):  # a positional with nothing is not given
                given = set(getattr(namespace, GIVEN, ()))
                setattr(namespace, GIVEN, given | {self.dest})

        action.__class__ = type(f"Given{base.__name__}", (base,), {"__call__": call})


def environment_defaults(parser: argparse.ArgumentParser) -> tuple[list[str], set[str]]:
    """SCRATCHLLM_<OPTION> in the environment sets the option's default (a flag still wins).
    Returns (the problems found, reported when the command runs, not while --help is built;
    the dests the environment set)."""
    errors: list[str] = []
    set_by_env: set[str] = set()
    for key, action in long_options(parser).items():
        if action.default is argparse.SUPPRESS or action.dest in NOT_IN_FILE:
            continue
        var = ENV_PREFIX + key.upper().replace("-", "_")
        if var not in os.environ:
            continue
        raw = os.environ[var]
        if action.nargs == 0:  # a switch such as --fake-engine
            if raw.lower() not in ("1", "true", "yes", "0", "false", "no", ""):
                errors.append(f"{var}={raw!r}: expected 1/true/yes or 0/false/no")
                continue
            action.default = raw.lower() in ("1", "true", "yes")
        else:
            try:
                value = action.type(raw) if callable(action.type) else raw
            except (ValueError, argparse.ArgumentTypeError):
                errors.append(f"{var}={raw!r} is not a valid value for --{key}")
                continue
            if action.choices is not None and value not in action.choices:
                errors.append(f"{var}={raw!r}: --{key} takes one of {', '.join(map(str, action.choices))}")
                continue
            action.default = value
        set_by_env.add(action.dest)
    return errors, set_by_env


def read_config(path: str, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """The file's options as dest -> value, each checked against its option; ConfigError naming
    the file and the key on anything wrong."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as err:
        raise ConfigError(f"config file {path}: {err.strerror or err}") from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"config file {path}: not TOML: {err}") from None
    options = long_options(parser)
    known = sorted({k for k, a in options.items() if a.dest not in NOT_IN_FILE} | set(MODELS_KEYS))
    values: dict[str, Any] = {}
    for raw_key, value in data.items():
        key = raw_key.replace("_", "-")
        if key not in known:
            near = difflib.get_close_matches(key, known, n=1)
            hint = f" (did you mean '{near[0]}'?)" if near else ""
            raise ConfigError(f"config file {path}: unknown key '{raw_key}'{hint}; the keys are serve's options")
        dest = "model_arg" if key in MODELS_KEYS else options[key].dest
        if dest in values:
            raise ConfigError(f"config file {path}: key '{raw_key}' is given twice (as '-' and '_' spellings, "
                              "or both 'model' and 'models')")
        try:
            values[dest] = _models(value) if key in MODELS_KEYS else _coerce(options[key], value)
        except ValueError as err:
            raise ConfigError(f"config file {path}: key '{raw_key}': {err}") from None
    return values


def _kind(value: Any) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
            dict: "a table"}.get(type(value), type(value).__name__)


def _models(value: Any) -> list[str]:
    models = [value] if isinstance(value, str) else value
    if not isinstance(models, list) or not models or not all(isinstance(m, str) and m for m in models):
        raise ValueError(f"expected a model name or an array of them, got {_kind(value)}")
    return list(models)


def _coerce(action: argparse.Action, value: Any) -> Any:
    """`value` as the option holds it: a switch takes a boolean; a number option a number; any
    other option a string, read as the command line would read it (sizes, durations, choices)."""
    convert: Callable[[str], Any] | None = action.type if callable(action.type) else None
    if action.nargs == 0:
        if not isinstance(value, bool):
            raise ValueError(f"expected true or false, got {_kind(value)}")
        return value
    if convert in (int, float):
        numeric = isinstance(value, int | float) and not isinstance(value, bool)
        if not numeric or (convert is int and not isinstance(value, int)):
            raise ValueError(f"expected {'an integer' if convert is int else 'a number'}, got {_kind(value)}")
        result: Any = convert(value)
    elif isinstance(value, str):
        try:
            result = convert(value) if convert is not None else value
        except (ValueError, argparse.ArgumentTypeError) as err:
            raise ValueError(str(err) or f"{value!r} is not a valid value") from None
    elif isinstance(value, int | float) and not isinstance(value, bool) and convert is not None:
        try:  # a size or a duration given as a number (bytes, seconds)
            result = convert(str(value))
        except (ValueError, argparse.ArgumentTypeError) as err:
            raise ValueError(str(err)) from None
    else:
        raise ValueError(f"expected a string, got {_kind(value)}")
    if action.choices is not None and result not in action.choices:
        raise ValueError(f"{value!r} is not one of {', '.join(map(str, action.choices))}")
    return result


def apply_config(args: argparse.Namespace, parser: argparse.ArgumentParser,
                 env_set: set[str]) -> dict[str, str]:
    """Fill in the config file's options under the flags and the environment (the module doc's
    order). Returns dest -> where its value came from: "flag", "environment", "file" or "default"."""
    given: set[str] = set(getattr(args, GIVEN, ()))
    path = getattr(args, "config", None) or os.environ.get(CONFIG_ENV)
    from_file = read_config(path, parser) if path else {}
    models_given = bool({"model_arg", "model"} & given) or "model" in env_set
    sources: dict[str, str] = {}
    for action in parser._actions:
        dest = action.dest
        if dest in (argparse.SUPPRESS, *NOT_IN_FILE) or not hasattr(args, dest):
            continue
        if dest in given:
            sources[dest] = "flag"
        elif dest in env_set:
            sources[dest] = "environment"
        elif dest in from_file and not (dest in MODELS_DESTS and models_given):
            setattr(args, dest, from_file[dest])
            sources[dest] = "file"
        else:
            sources[dest] = "default"
    if path:
        sources["config"] = "flag" if "config" in given else "environment"
    return sources


def render_config(args: argparse.Namespace, parser: argparse.ArgumentParser, sources: dict[str, str],
                  models: list[str]) -> str:
    """The options in effect as a TOML file `--config` reads back, each with its source."""
    lines = ["# scratchllm serve: the options in effect. Each comes from, lowest first: its default,",
             "# the config file, a SCRATCHLLM_* variable, a flag (the last one given wins).",
             f"models = {_toml(models)}  # {_models_source(sources)}"]
    for key, action in long_options(parser).items():
        if action.dest in NOT_IN_FILE or action.dest in MODELS_DESTS or not hasattr(args, action.dest):
            continue
        value, source = getattr(args, action.dest), sources.get(action.dest, "default")
        if value is None:
            lines.append(f"# {key} (not set)  # {source}")
        elif key in SECRETS:
            lines.append(f"# {key} (set, not shown)  # {source}")
        else:
            lines.append(f"{key} = {_toml(value)}  # {source}")
    return "\n".join(lines) + "\n"


def _models_source(sources: dict[str, str]) -> str:
    kinds = {sources.get("model_arg", "default"), sources.get("model", "default")} - {"default"}
    return " and ".join(sorted(kinds)) if kinds else "default"


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return json.dumps(str(value))  # a JSON string is a TOML basic string
