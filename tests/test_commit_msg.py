"""scripts/check_commit_msg.py, the commit-msg hook: the subject's length and the blank line."""

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "check_commit_msg.py"
spec = importlib.util.spec_from_file_location("check_commit_msg", SCRIPT)
assert spec is not None and spec.loader is not None
check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(check)


def test_a_short_subject_with_a_body_passes():
    assert check.problems("engine: one sampling path\n\nThe static baseline sampled raw logits.\n") == []
    assert check.problems("x" * 72 + "\n# a comment git strips\n") == []


def test_a_long_subject_an_empty_one_and_a_missing_blank_line_are_each_said():
    assert "73 characters" in check.problems("x" * 73)[0]
    assert check.problems("\n\nbody") == ["the subject line is empty"]
    assert check.problems("subject\nbody at once") == ["the subject and the body need a blank line between them"]


def test_the_hook_exits_1_on_a_bad_message(tmp_path):
    (tmp_path / "msg").write_text("y" * 100 + "\n")
    (tmp_path / "ok").write_text("fine\n")
    assert check.main([str(tmp_path / "msg")]) == 1
    assert check.main([str(tmp_path / "ok")]) == 0
