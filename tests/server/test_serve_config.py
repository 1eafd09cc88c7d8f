"""`scratchllm serve --config FILE.toml`: every option from a file, under SCRATCHLLM_* variables and
flags; `--print-config` shows the result as a file that reads back; a bad key or type is refused
at start, naming the file and the key. The printed file is parsed with Python's own tomllib."""

import tomllib

import pytest

from scratchllm.cli import serve_cmd
from scratchllm.cli.main import build_parser, main


def printed(capsys, argv):
    assert main(["serve", *argv, "--print-config"]) == 0
    text = capsys.readouterr().out
    sources = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, source = line.partition("  # ")
            sources[key.split(" = ")[0]] = source
    return tomllib.loads(text), sources, text


def write(tmp_path, text, name="serve.toml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_the_file_is_under_the_environment_and_the_flags(tmp_path, capsys, monkeypatch):
    config = write(tmp_path, 'models = ["alpha", "beta"]\nport = 9000\nmax_num_seqs = 3\napi-key = "from-file"\n'
                             'keep-alive = "5m"\nkv-cache-memory = "24MiB"\nlenient-fields = true\nhost = "0.0.0.0"\n')
    monkeypatch.setenv("SCRATCHLLM_MAX_NUM_SEQS", "5")
    monkeypatch.setenv("SCRATCHLLM_HOST", "127.0.0.2")
    values, sources, text = printed(capsys, ["--config", config, "--api-key", "from-flag", "--port", "8000"])
    assert values["models"] == ["alpha", "beta"] and sources["models"] == "file"
    assert (values["port"], sources["port"]) == (8000, "flag")  # a flag equal to the default still wins
    assert (values["max-num-seqs"], sources["max-num-seqs"]) == (5, "environment")
    assert (values["host"], sources["host"]) == ("127.0.0.2", "environment")
    assert "api-key" not in values and "# api-key (set, not shown)  # flag" in text  # a secret is never printed
    assert (values["keep-alive"], values["kv-cache-memory"], values["lenient-fields"]) == (300.0, 24 << 20, True)
    assert sources["keep-alive"] == sources["lenient-fields"] == "file"
    assert (values["drain-timeout"], sources["drain-timeout"]) == (60.0, "default")
    # models named on the command line replace the file's
    values, sources, _ = printed(capsys, ["--config", config, "gamma"])
    assert values["models"] == ["gamma"] and sources["models"] == "flag"


def test_the_printed_config_reads_back_the_same(tmp_path, capsys):
    _, _, first = printed(capsys, ["alpha", "-m", "beta", "--fake-engine", "--keep-alive", "90s", "--threads", "2",
                                   "--memory-budget", "3GiB", "--load", "first-use", "--log-level", "info"])
    values, sources, again = printed(capsys, ["--config", write(tmp_path, first)])
    assert set(sources.values()) <= {"file", "default"}
    strip = [line.split("  # ")[0] for line in first.splitlines()]
    assert strip == [line.split("  # ")[0] for line in again.splitlines()]
    assert values["models"] == ["alpha", "beta"] and values["fake-engine"] is True and values["keep-alive"] == 90.0


def test_the_files_models_and_options_are_what_is_served(tmp_path):
    config = write(tmp_path, 'models = ["alpha", "beta"]\nfake-engine = true\nembedding-model = "none"\n'
                             'keep-alive = 2.5\nmax-num-seqs = 3\n')
    args = build_parser().parse_args(["serve", "--config", config])
    serve_cmd.apply_config(args, args.serve_parser, args.env_set)
    registry = serve_cmd.build(args)
    assert registry.names() == ["alpha", "beta"] and registry.keep_alive_s == 2.5
    assert registry.specs[0].load().engine.max_running == 3


@pytest.mark.parametrize(("text", "named"), [
    ("max-num-seq = 4\n", "unknown key 'max-num-seq' (did you mean 'max-num-seqs'?)"),
    ("[server]\nport = 1\n", "unknown key 'server'"),
    ("port = 'eight'\n", "key 'port': expected an integer, got a string"),
    ("port = 80.5\n", "key 'port': expected an integer, got a number"),
    ("fake-engine = 'yes'\n", "key 'fake-engine': expected true or false, got a string"),
    ("load = 'sometimes'\n", "key 'load': 'sometimes' is not one of start, first-use"),
    ("kv-cache-memory = '12XB'\n", "key 'kv-cache-memory': '12XB' is not a size"),
    ("keep-alive = 'a while'\n", "key 'keep-alive': keep_alive 'a while' is not a duration"),
    ("models = [1, 2]\n", "key 'models': expected a model name or an array of them"),
    ("print-config = true\n", "unknown key 'print-config'"),
    ("max_num_seqs = 2\nmax-num-seqs = 3\n", "key 'max-num-seqs' is given twice"),
    ("port = \n", "not TOML"),
])
def test_a_bad_key_or_type_is_refused_at_start_naming_it(tmp_path, capsys, text, named):
    config = write(tmp_path, text, "bad.toml")
    assert main(["serve", "--fake-engine", "--port", "0", "--config", config]) == 2
    err = capsys.readouterr().err
    assert f"config file {config}: " in err and named in err, err


def test_a_missing_config_file_is_named(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SCRATCHLLM_CONFIG", str(tmp_path / "nowhere.toml"))
    assert main(["serve", "--fake-engine", "--port", "0"]) == 2
    assert "nowhere.toml: No such file" in capsys.readouterr().err
