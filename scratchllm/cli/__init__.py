"""The `scratchllm` command line. Each sub-command lives in its own module here."""

import argparse
from collections.abc import Callable
from typing import TypeAlias

# What each sub-command's add_parser(sub) is given: the sub-parsers of the `scratchllm` parser.
# (A string: argparse's class is generic only to the type checker.)
Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


def help_func(parser: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    """The `func` of a command given without its sub-command: print the command's help, exit 2."""
    def func(_args: argparse.Namespace) -> int:
        parser.print_help()
        return 2

    return func
