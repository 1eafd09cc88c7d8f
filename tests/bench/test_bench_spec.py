"""`bench spec`: its prompt sets load, llama.cpp's speculative programs are driven and read as
they print, and (with `make peers` built) one short run of each of them on the default model."""

import pytest

from scratchllm.bench import llama_tools, spec_peers
from scratchllm.bench.spec_workloads import WORKLOADS, load_cases
from scratchllm.errors import ConfigError

# the end of llama-speculative-simple's log (llama-lookup's has the same lines, and t_draft lines)
SPECULATIVE_LOG = """\
0.52.185.144 I encoded   22 tokens in    4.963 seconds, speed:    9.470 t/s
0.52.185.155 I decoded  257 tokens in    8.421 seconds, speed:   30.519 t/s
0.52.185.155 I
0.52.185.155 I n_draft      = 5
0.52.185.156 I n_predict    = 257
0.52.185.156 I n_drafted    = 210
0.52.185.158 I n_accept     = 147
0.52.185.158 I accept       = 70.000%
"""


def test_speculative_figures_are_read_as_printed():
    got = llama_tools.parse_speculative(SPECULATIVE_LOG)
    assert got == {"prefill_tok_s": 9.47, "decode_tok_s": 30.519, "decoded": 257, "drafted": 210, "accepted": 147,
                   "accept_rate": 0.7}
    with pytest.raises(ConfigError, match="no speculative figures"):
        llama_tools.parse_speculative("error: failed to load model\n")


def test_command_lines():
    argv = llama_tools.speculative_args("t.gguf", "p.txt", 2, 256, 4096, 5, "draft-simple", "d.gguf")
    assert argv[argv.index("-md") + 1] == "d.gguf" and argv[argv.index("--spec-draft-n-max") + 1] == "5"
    assert argv[argv.index("--spec-type") + 1] == "draft-simple" and argv[argv.index("--temp") + 1] == "0"
    ngram = llama_tools.speculative_args("t.gguf", "p.txt", 2, 256, 4096, 5, "ngram-mod")
    assert "-md" not in ngram and ngram[ngram.index("--spec-type") + 1] == "ngram-mod"
    lookup = llama_tools.lookup_args("t.gguf", "p.txt", 2, 256, 4096, 5)
    assert lookup[lookup.index("--spec-draft-n-max") + 1] == "5" and lookup[lookup.index("-f") + 1] == "p.txt"


def test_the_prompt_sets_load():
    cases = load_cases(list(WORKLOADS))
    assert {c.workload for c in cases} == set(WORKLOADS) and len(cases) >= 10
    edits = [c for c in cases if c.workload == "code-edits"]
    assert all(c.messages[0]["role"] == "system" and "```" in c.messages[-1]["content"] for c in edits)
    assert len(load_cases(["code-edits"], limit=2)) == 2
    with pytest.raises(ConfigError, match="no prompt set 'nope'"):
        load_cases(["nope"])


@pytest.mark.slow
@pytest.mark.skipif(not spec_peers.available(), reason="llama.cpp's programs not built (make peers)")
@pytest.mark.parametrize("mode", ["lookup", "draft-simple"])  # each program once (the n-gram types share the draft's)
def test_each_llama_cpp_program_runs_on_the_default_model(mode):
    from scratchllm.formats.refs import resolve_model

    path = str(resolve_model("default"))
    text = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return"
    got = spec_peers.run_case(mode, path, path, text, 2, 8, 3)
    assert got["decoded"] >= 1 and got["decode_tok_s"] > 0 and got["peak_rss_mb"] > 10
    assert 0 <= got["accepted"] <= got["drafted"]


@pytest.mark.slow
def test_a_short_run_of_ours_measures_and_checks_identity():
    import argparse

    from scratchllm.bench import spec

    parser = argparse.ArgumentParser()
    spec.add_arguments(parser)
    r = spec.run(parser.parse_args(["--model", "default", "--draft", "default", "--cases", "1", "--max-tokens", "12",
                                    "--rounds", "1", "--sides", "off,ngram,draft"]))
    for workload in ("code-edits", "code-questions"):
        row = r["rows"][workload]
        assert all(row[side]["decode_tok_s"] > 0 and row[side]["identical"] == "1/1" for side in spec.OURS)
    assert r["rows"]["peak_rss_mb"]["draft"] > 0 and "draft model" in r["rounds"][0]["draft"]["memory_plan"]
    text = spec.render(r)
    assert "code-edits:" in text and "ours ngram" in text and "command: scratchllm" in text


@pytest.mark.slow
def test_in_turns_runs_our_sides_in_one_process_case_by_case():
    import argparse

    from scratchllm.bench import spec

    parser = argparse.ArgumentParser()
    spec.add_arguments(parser)
    r = spec.run(parser.parse_args(["--model", "default", "--draft", "default", "--cases", "1", "--max-tokens", "12",
                                    "--rounds", "2", "--sides", "off,ngram", "--in-turns", "--workloads",
                                    "code-edits"]))
    assert r["inputs"]["in_turns"] and len(r["rounds"]) == 2
    for rnd in r["rounds"]:  # one process: every side reports that process's peak
        assert rnd["off"]["peak_rss_mb"] == rnd["ngram"]["peak_rss_mb"] > 0
    row = r["rows"]["code-edits"]
    assert row["ngram"]["identical"] == "2/2" and row["off"]["decode_tok_s"] > 0
    assert "taking turns case by case" in spec.render(r)


@pytest.mark.parametrize("flag", ["--cases", "--max-tokens"])
def test_a_count_below_one_is_one_line(flag, capsys):
    from scratchllm.cli.main import main

    assert main(["bench", "spec", flag, "0"]) == 2
    assert f"{flag} must be >= 1, got 0" in capsys.readouterr().err
