"""`make demo`: the main job on the default model, then what the model files hold."""

import sys

from scratchllm.cli.main import main

QUESTIONS = ["What is the capital of France?", "Name three primary colors.", "What is 2 + 2?"]


def run() -> int:
    commands = [["generate", q, "--max-tokens", "48", "--temperature", "0"] for q in QUESTIONS]
    commands += [["inspect", "default", "--limit", "12"], ["inspect", "minilm", "--limit", "12"]]
    for argv in commands:
        print(f"$ scratchllm {' '.join(argv)}", flush=True)
        status = main(argv)
        if status:
            return status
        print(flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(run())
