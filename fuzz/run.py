"""Coverage-guided fuzzing of one parser with atheris (libFuzzer for Python).

    python fuzz/run.py TARGET [libFuzzer options and corpus folders]
    python fuzz/run.py gguf fuzz/corpus/gguf -max_total_time=60

TARGET is one of fuzz/targets.py's TARGETS, or `all` (every_target: the first byte picks one).
The scratchllm package is instrumented for coverage; an exception other than the project's own
errors stops the run and writes the input that raised it (crash-<hash>) where -artifact_prefix
says. `make fuzz` runs every target in turn.
"""

import os
import sys

import atheris

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout's scratchllm

with atheris.instrument_imports(include=["scratchllm"]):
    import scratchllm.formats.gguf
    import scratchllm.formats.safetensors
    import scratchllm.formats.torchzip
    import scratchllm.formats.unpickle
    import scratchllm.tokenizer.chat
    import scratchllm.tokenizer.loaders  # noqa: F401

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from targets import TARGETS, every_target


def main() -> None:
    targets = {**TARGETS, "all": every_target}
    if len(sys.argv) < 2 or sys.argv[1] not in targets:
        sys.exit(f"usage: fuzz/run.py {{{','.join(targets)}}} [libFuzzer options] [corpus folders]")
    target = targets[sys.argv.pop(1)]
    atheris.Setup(sys.argv, target)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
