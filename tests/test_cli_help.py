"""The command line as a newcomer meets it: every option of every command says what it does and
what it defaults to, a failed start leaves nothing behind, and a port in use is one clear line."""

import argparse
import socket

import pytest

from scratchllm.cli.main import build_parser, main, walk_parsers

SKIP = (argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction)


def _help_offences(parser: argparse.ArgumentParser) -> list[str]:
    offences = []
    for path, p in walk_parsers(parser):
        formatter = p._get_formatter()
        for action in p._actions:
            if isinstance(action, SKIP):
                continue
            name = f"{' '.join(path)} {'/'.join(action.option_strings) or action.metavar or action.dest}"
            if not (action.help or "").strip() or action.help == argparse.SUPPRESS:
                offences.append(f"{name}: no help")
                continue
            shown = formatter._expand_help(action)
            off = action.default in (None, False, argparse.SUPPRESS) or isinstance(action, argparse._StoreTrueAction)
            if action.option_strings and not off and "default" not in shown.lower():
                offences.append(f"{name}: its default {action.default!r} is not shown")
    return offences


def test_every_option_of_every_command_has_help_and_shows_its_default():
    assert _help_offences(build_parser()) == []


def test_the_walk_finds_what_it_looks_for():
    """A planted option without help, and one whose default is not shown, are both reported."""
    parser = argparse.ArgumentParser(prog="scratchllm")
    planted = parser.add_subparsers().add_parser("serve")
    planted.add_argument("--planted-no-help", default=3)
    planted.add_argument("--planted-shown", default=7, help="shown (default %(default)s)")
    planted.add_argument("--planted-plain", default=9, help="no word about it")
    assert _help_offences(parser) == ["scratchllm serve --planted-no-help: no help",
                                      "scratchllm serve --planted-plain: its default 9 is not shown"]


def test_serve_help_shows_the_defaults_a_newcomer_looks_for(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for shown in ("(default: 8000)", "(default: 0.01)", "(default: minilm)", "(default: 64)",
                  "default: 16 for the continuous engine", "address to listen on"):
        assert shown in text, shown


def test_generate_takes_the_model_as_serve_does(monkeypatch):
    seen = {}
    monkeypatch.setattr("scratchllm.cli.generate_cmd.run", lambda args: seen.setdefault("args", args) and 0)
    parser = build_parser()
    for argv, model, prompt in ((["generate", "Hi"], None, "Hi"),
                                (["generate", "minilm", "Hi"], "minilm", "Hi"),
                                (["generate", "minilm", "-n", "5", "Hi"], "minilm", "Hi"),
                                (["generate", "-n", "5", "minilm", "Hi"], "minilm", "Hi")):
        from scratchllm.cli.main import parse

        args = parse(parser, argv)
        assert (args.model_arg, args.prompt) == (model, prompt), argv


def test_generate_with_two_different_models_is_one_clear_error(capsys):
    assert main(["generate", "minilm", "--model", "default", "x"]) == 2
    assert "two models given: 'minilm' and --model 'default'" in capsys.readouterr().err


def test_a_failed_start_leaves_the_trace_ring_and_the_capture_folder_alone(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("SCRATCHLLM_CAPTURE_KEY", raising=False)
    ring = tmp_path / "crash.ring"
    ring.write_bytes(b"the ring of a crashed server")
    capture = tmp_path / "capture"
    assert main(["serve", "--fake-engine", "--trace", str(ring), "--capture", str(capture), "--port", "0"]) == 2
    assert "capture needs a secret key" in capsys.readouterr().err
    assert ring.read_bytes() == b"the ring of a crashed server"
    assert not capture.exists()


@pytest.fixture
def busy_port():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    yield sock.getsockname()[1]
    sock.close()


def test_serve_on_a_port_in_use_is_one_clear_error_before_loading(busy_port, capsys, tmp_path):
    ring = tmp_path / "r.ring"
    assert main(["serve", "--fake-engine", "--trace", str(ring), "--port", str(busy_port)]) == 2
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{busy_port}" in err and "pick another --port" in err
    assert not ring.exists()


def test_the_printed_address_accepts_connections_before_the_server_loop_runs(capsys, monkeypatch, tmp_path):
    """Scripts take the address line as "ready" and connect at once; the server's loop starts a
    moment later. A connection made in between waits in the backlog instead of being refused."""
    import re

    import uvicorn

    seen = []

    def loop_not_yet_running(self, sockets=None):
        address = re.search(r"on http://([\d.]+):(\d+)", capsys.readouterr().err)
        assert address, "the address line comes before the loop runs"
        with socket.create_connection((address.group(1), int(address.group(2))), timeout=5):
            seen.append(address.group(0))  # connected: nothing refused it
        for sock in sockets:
            sock.close()  # what the loop does when it stops

    monkeypatch.setattr(uvicorn.Server, "run", loop_not_yet_running)
    assert main(["serve", "--fake-engine", "--trace", "none", "--embedding-model", "none", "--port", "0"]) == 0
    assert len(seen) == 1


def test_a_command_builds_only_its_own_parser_and_parses_as_the_whole_one_does():
    """`scratchllm serve` is a long-running process: its parser must not import the benches (their
    HTTP clients and parsers, about 7 MB of a server's resident memory), and what it parses must
    be what the whole parser parses."""
    import subprocess
    import sys

    from scratchllm.cli.main import chosen_command

    argv = ["--log-level", "info", "serve", "default", "--port", "0", "--max-num-seqs", "4"]
    assert chosen_command(argv) == "serve" and chosen_command(["--help"]) is None

    def parsed(parser: argparse.ArgumentParser) -> dict:  # the values, without the functions and parsers set
        return {k: v for k, v in vars(parser.parse_args(argv)).items() if not callable(v) and
                not isinstance(v, argparse.ArgumentParser)}

    assert vars(build_parser(only="serve").parse_args(argv)).keys() == vars(build_parser().parse_args(argv)).keys()
    assert parsed(build_parser(only="serve")) == parsed(build_parser()) and parsed(build_parser())["port"] == 0
    code = ("import sys\nfrom scratchllm.cli.main import build_parser\n{}\n"
            "print(sorted(m for m in sys.modules if m.split('.')[:2] == ['scratchllm', 'bench'] and m.count('.') == 2"
            " and m != 'scratchllm.bench.common' or m.split('.')[0] == 'httpx'))")
    only = subprocess.run([sys.executable, "-c", code.format("build_parser(only='serve')")], capture_output=True,
                          text=True, check=True).stdout.strip()
    whole = subprocess.run([sys.executable, "-c", code.format("build_parser()")], capture_output=True, text=True,
                           check=True).stdout.strip()
    assert only == "[]"
    assert "'scratchllm.bench.serving'" in whole and "'httpx'" in whole  # what the check looks for is there
