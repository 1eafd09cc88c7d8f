"""The diff-based evaluation loop: capture traffic, replay it on primary, secondary and candidate
servers, diff and triage the outputs at the token level, annotate the diffs, report, and feed the
scores back into scheduling. See docs/evaluation.md."""
