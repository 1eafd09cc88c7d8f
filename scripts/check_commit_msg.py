"""A commit message's shape (the pre-commit `commit-msg` hook): a subject line of at most 72
characters, then, if there is more, a blank line before the body. Exit 1 with the reason.

Usage: python scripts/check_commit_msg.py FILE   (the file git hands the hook), or
       python scripts/check_commit_msg.py --range A..B   (every commit in a range, for review)."""

import subprocess
import sys

LIMIT = 72


def problems(message: str) -> list[str]:
    lines = [line for line in message.splitlines() if not line.startswith("#")]
    if not lines or not lines[0].strip():
        return ["the subject line is empty"]
    out = []
    if len(lines[0]) > LIMIT:
        out.append(f"the subject is {len(lines[0])} characters, more than {LIMIT}: say what changed in the "
                   "subject and why in the body")
    if len(lines) > 1 and lines[1].strip():
        out.append("the subject and the body need a blank line between them")
    return out


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "--range":
        shas = subprocess.run(["git", "rev-list", "--no-merges", argv[1]], capture_output=True, text=True,
                              check=True).stdout.split()
        bad = 0
        for sha in shas:
            msg = subprocess.run(["git", "log", "-1", "--format=%B", sha], capture_output=True, text=True,
                                 check=True).stdout
            for p in problems(msg):
                print(f"{sha[:10]}: {p}")
                bad += 1
        return 1 if bad else 0
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    with open(argv[0], encoding="utf-8") as f:
        found = problems(f.read())
    for p in found:
        print(f"commit message: {p}", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
