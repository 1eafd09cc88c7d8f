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
