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

from scratchllm import __version__
from scratchllm.errors import ScratchLLMError

COMMANDS = ["inspect", "generate", "serve", "bench", "trace", "eval"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="scratchllm",
        description="An LLM inference system built from first principles: every layer visible, "
        "measured and replaceable. Models: 'default' (SmolLM2-135M-Instruct, GGUF Q4_1), 'minilm' "
        "(all-MiniLM-L6-v2), or a path to a .gguf file or a Hugging Face model folder.",
    )
    parser.add_argument("--version", action="version", version=f"scratchllm {__version__}")
    parser.add_argument("--log-level", default="warning", type=str.lower,
                        choices=["debug", "info", "warning", "error", "critical"],
                        help="what the library logs on stderr (default warning); `serve --log-level` also sets it")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        module_name = f"scratchllm.cli.{name}_cmd"
        if importlib.util.find_spec(module_name) is None:
            continue  # a command not built yet is simply absent from --help
        importlib.import_module(module_name).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
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
