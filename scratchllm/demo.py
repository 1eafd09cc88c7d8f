"""`make demo`: the main job on the default model, then what the model files hold."""

import sys

from scratchllm.cli.main import main


def run() -> int:
    for argv in (["inspect", "default"], ["inspect", "minilm"]):
        print(f"$ scratchllm {' '.join(argv)}", flush=True)
        status = main(argv)
        if status:
            return status
        print(flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(run())
