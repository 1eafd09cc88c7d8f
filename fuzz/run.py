"""Coverage-guided fuzzing of one parser with atheris (libFuzzer for Python).

    python fuzz/run.py TARGET [libFuzzer options and corpus folders]
    python fuzz/run.py gguf fuzz/corpus/gguf -max_total_time=60

TARGET is one of fuzz/targets.py's TARGETS. The scratchllm package is instrumented for coverage;
an exception other than the project's own errors stops the run and writes the input that raised
it (crash-<hash>) where -artifact_prefix says. `make fuzz` runs every target in turn.
"""

import os
import sys

import atheris

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout's scratchllm

with atheris.instrument_imports(include=["scratchllm"]):
    import scratchllm.formats.gguf  # noqa: F401 - imported here so that atheris instruments them
    import scratchllm.formats.safetensors  # noqa: F401
    import scratchllm.formats.torchzip  # noqa: F401
    import scratchllm.formats.unpickle  # noqa: F401
    import scratchllm.tokenizer.chat  # noqa: F401
    import scratchllm.tokenizer.loaders  # noqa: F401

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from targets import TARGETS  # noqa: E402


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in TARGETS:
        sys.exit(f"usage: fuzz/run.py {{{','.join(TARGETS)}}} [libFuzzer options] [corpus folders]")
    target = TARGETS[sys.argv.pop(1)]
    atheris.Setup(sys.argv, target)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
