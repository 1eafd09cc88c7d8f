"""Entry point of the `scratchllm` console script.

Every sub-command is a module in scratchllm.cli with ``add_parser(subparsers)``, which registers
its parser and sets ``func(args) -> int``. Errors that are the user's input (ScratchLLMError:
a bad file, a bad flag) print as one line on stderr and exit with status 2, no traceback.
"""

import argparse
import importlib
import importlib.util
import logging
import sys
from collections.abc import Iterator

from scratchllm import __version__
from scratchllm.errors import ScratchLLMError

COMMANDS = ["inspect", "generate", "serve", "run-batch", "models", "bench", "trace", "eval", "version"]


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default, unless the help already says it: an option that
    defaults to something (not None, not a flag that is off) shows what that is."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (not action.option_strings or "default" in text.lower() or default in (None, argparse.SUPPRESS)
                or isinstance(action, argparse._StoreConstAction | argparse._StoreTrueAction)):
            return text
        if isinstance(default, list | tuple) and not default:
            return text + " (default: none)"
        return text + " (default: %(default)s)"


class RawDefaultsHelpFormatter(DefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """The same, for parsers whose description is laid out by hand."""


def walk_parsers(parser: argparse.ArgumentParser, path: tuple[str, ...] = ("scratchllm",)
                 ) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """(command path, parser) for the parser and every sub-command below it."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from walk_parsers(child, (*path, name))


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole parser; with `only`, the parser of that one command (what `main` runs): the other
    commands' modules are not imported, so a long-running `serve` does not hold the benches'
    HTTP clients and parsers in its memory."""
    parser = argparse.ArgumentParser(
        prog="scratchllm",
        description="An LLM inference system built from first principles: every layer visible, "
        "measured and replaceable. Models: 'default' (SmolLM2-135M-Instruct, GGUF Q4_1), 'minilm' "
        "(all-MiniLM-L6-v2), a path to a .gguf file or a Hugging Face model folder, or a name `scratchllm models "
        "list` shows (Ollama's models, the Hugging Face cache).",
    )
    parser.add_argument("--version", action="version", version=f"scratchllm {__version__}")
    parser.add_argument("--log-level", default="warning", type=str.lower,
                        choices=["debug", "info", "warning", "error", "critical"],
                        help="what the library logs on stderr (default warning); `serve --log-level` also sets it")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS if only is None else [only]:
        module_name = f"scratchllm.cli.{name.replace('-', '_')}_cmd"
        if importlib.util.find_spec(module_name) is None:
            continue  # a command not built yet is simply absent from --help
        importlib.import_module(module_name).add_parser(sub)
    for _, p in walk_parsers(parser):
        kind = p.formatter_class
        raw = isinstance(kind, type) and issubclass(kind, argparse.RawDescriptionHelpFormatter)
        p.formatter_class = RawDefaultsHelpFormatter if raw else DefaultsHelpFormatter
    return parser


def parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """The arguments; a command whose parser set `intermixed_parser` (two positionals, such as
    `generate MODEL PROMPT`) has its own arguments parsed intermixed, so options may stand
    between its positionals (`generate default -n 5 "Hi"`)."""
    args, extra = parser.parse_known_args(argv)
    command_parser: argparse.ArgumentParser | None = getattr(args, "intermixed_parser", None)
    if command_parser is not None:
        return command_parser.parse_intermixed_args(argv[argv.index(args.command) + 1:], namespace=args)
    passed_on = getattr(args, "unknown_args_to", None)  # a command that hands its other words to another's parser
    if extra and passed_on is not None:
        setattr(args, passed_on, extra)
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def chosen_command(argv: list[str]) -> str | None:
    """The command `argv` runs: its first word that names one (None: none does, e.g. `--help`)."""
    return next((word for word in argv if word in COMMANDS), None)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(only=chosen_command(argv))
    args = parse(parser, argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except ScratchLLMError as err:
        print(f"scratchllm {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
