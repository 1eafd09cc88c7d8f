"""A load's long steps report their progress: the first load of a GGUF file packs its matrices and
writes the panel cache, a later one only maps them; on a terminal each step is a tqdm bar, in a
log or a pipe one line when it ends."""

import io

import pytest

from scratchllm.models import load_model
from scratchllm.models.progress import PACKING, WRITING_CACHE, console_sink, report, reporting


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SCRATCHLLM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("SCRATCHLLM_PANEL_CACHE", raising=False)


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_the_first_load_reports_packing_and_the_panel_cache_a_later_one_packing_only(fresh_cache):
    first, later = [], []
    with reporting(lambda *r: first.append(r)):
        model = load_model("default")
    with reporting(lambda *r: later.append(r)):
        load_model("default")
    layers = model.config.num_layers
    packing = [r for r in first if r[0] == PACKING]
    assert packing == [(PACKING, i, layers + 1) for i in range(1, layers + 2)]  # each layer, then the LM head
    writing = [r for r in first if r[0] == WRITING_CACHE]
    assert len(writing) > layers and writing[-1][1] == writing[-1][2] and [r[1] for r in writing] == sorted(
        r[1] for r in writing)
    assert {r[0] for r in later} == {PACKING}  # mapped from the cache: nothing written
    with reporting(lambda *r: first.append(("outside",))):
        pass
    report(PACKING, 1, 2)  # no sink here: nothing is called
    assert ("outside",) not in first


def test_a_terminal_gets_a_bar_and_a_pipe_lines():
    tty = Terminal()
    sink = console_sink("gemma3-270m", tty, show_after_s=0.0)
    for i in range(1, 6):
        sink(PACKING, i, 5)
    assert "gemma3-270m: packing the weights" in tty.getvalue() and "5/5" in tty.getvalue()
    piped = io.StringIO()
    sink = console_sink("gemma3-270m", piped, show_after_s=0.0)
    for i in range(1, 21):
        sink(WRITING_CACHE, i, 20)
    lines = piped.getvalue().splitlines()
    assert "\r" not in piped.getvalue() and lines[-1].startswith("gemma3-270m: writing the panel cache: done, 100%")
    assert 5 <= len(lines) <= 12  # a line at each tenth, not at each step


def test_a_step_that_ends_quickly_is_not_shown_nor_lines_before_the_server_serves():
    quiet = io.StringIO()
    sink = console_sink("default", quiet)  # the default: shown after a second
    for i in range(1, 32):
        sink(PACKING, i, 31)
    assert quiet.getvalue() == ""
    before = console_sink("default", quiet, show_after_s=0.0, terminal_only=True)
    for i in range(1, 32):
        before(PACKING, i, 31)
    assert quiet.getvalue() == ""
    tty = Terminal()
    bar = console_sink("default", tty, show_after_s=0.0, terminal_only=True)
    for i in range(1, 32):
        bar(PACKING, i, 31)
    assert "31/31" in tty.getvalue()


def test_generate_and_llm_show_a_load_s_long_steps(fresh_cache, monkeypatch, capfd):
    """`scratchllm generate` and `LLM(...)` show the load's steps as `serve` does (here every
    step counts as long: the threshold is a second): lines on a stream that is no terminal."""
    from scratchllm import LLM
    from scratchllm.cli.main import main
    from scratchllm.models import progress

    monkeypatch.setattr(progress, "SHOW_AFTER_S", 0.0)
    assert main(["generate", "default", "Hi", "-n", "1", "--raw", "-q"]) == 0
    err = capfd.readouterr().err
    assert "default: packing the weights: done, 100%" in err and "default: writing the panel cache: done" in err
    LLM("default", num_kv_blocks=8)  # the panels are cached now: packing only, from them
    err = capfd.readouterr().err
    assert "default: packing the weights: done, 100%" in err and "writing the panel cache" not in err
    monkeypatch.setattr(progress, "SHOW_AFTER_S", 1.0)
    LLM("default", num_kv_blocks=8)  # a quick load says nothing
    assert "default:" not in capfd.readouterr().err


def test_a_job_shown_part_done_says_each_tenth_once():
    from scratchllm.formats.progress import LineProgress

    out = io.StringIO()
    bar = LineProgress(total=300, initial=150, desc="x", file=out)
    for _ in range(150):
        bar.update(1)
    bar.close()
    tenths = [line.split(": ")[1].split("%")[0] for line in out.getvalue().splitlines()[1:-1]]
    assert tenths == ["60", "70", "80", "90"], out.getvalue()
