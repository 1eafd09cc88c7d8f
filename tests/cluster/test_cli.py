"""`scratchllm serve --replicas N`: the serve command's options become the cluster's spec, and
what the cluster cannot do is refused before Ray starts."""

import argparse

import pytest

from scratchllm.cli import serve_cmd
from scratchllm.errors import ConfigError

pytest.importorskip("ray", reason="the cluster extra (ray[serve]) is not installed")
from scratchllm.cluster import cli as cluster_cli


def parse(argv):
    parser = argparse.ArgumentParser()
    serve_cmd.add_parser(parser.add_subparsers())
    return parser.parse_args(["serve", *argv])


def spec_from_args(args):
    """The spec the serve command hands the cluster: the replica's options and the ingress's HTTP
    options, checked as for one process."""
    return cluster_cli.spec_from_args(args, serve_cmd.server_config(args))


def test_the_fake_engine_and_the_servers_limits_reach_the_spec():
    spec = spec_from_args(parse(["--replicas", "3", "--fake-engine", "--max-num-seqs", "5", "--fake-step-ms", "7",
                                 "--max-in-flight", "9", "--num-kv-blocks", "200"]))
    assert spec.replicas == 3 and spec.replica.fake and spec.server.max_in_flight == 9
    assert spec.replica.engine_options == {"max_running": 5, "step_ms": 7.0, "max_model_len": 2048, "num_blocks": 200}


def test_the_ingress_serves_with_every_http_option_one_process_takes(monkeypatch):
    """An API key, CORS origins, field strictness, pings and the tool-call format reach the
    ingress (an API key given with --replicas once served without one)."""
    spec = _started_spec(monkeypatch, ["--replicas", "2", "--fake-engine", "--api-key", "k3y", "--allowed-origins",
                                       "http://a.example", "--lenient-fields", "--sse-ping-interval", "4",
                                       "--tool-call-parser", "hermes", "--max-body-bytes", "1000"])
    assert spec.server.api_key == "k3y" and spec.server.allowed_origins == ("http://a.example",)
    assert spec.server.lenient_fields and spec.server.sse_ping_interval_s == 4.0
    assert spec.server.tool_call_parser == "hermes" and spec.server.max_body_bytes == 1000
    with pytest.raises(ConfigError, match="sse-ping-interval"):
        _started_spec(monkeypatch, ["--replicas", "2", "--fake-engine", "--sse-ping-interval", "-1"])


def test_a_model_replica_gets_the_engine_options():
    spec = spec_from_args(parse(["--replicas", "2", "--model", "default", "--max-num-seqs", "4", "--policy", "fcfs"]))
    assert spec.replica.model == "default" and spec.replica.engine_options == {"max_num_seqs": 4, "policy": "fcfs"}
    capped = spec_from_args(parse(["--replicas", "2", "--model", "default", "--prefix-cache-memory", "64MiB"]))
    assert capped.replica.engine_options == {"prefix_cache_memory_bytes": 64 * 2**20}


def _started_spec(monkeypatch, argv):
    """What `scratchllm serve ARGV` hands the cluster, through the command's own path (Ray's start
    replaced by a recorder)."""
    started = []
    monkeypatch.setattr("scratchllm.cluster.app.start", lambda spec, *rest: started.append(spec))
    assert serve_cmd.run(parse(argv)) == 0
    return started[0]


@pytest.mark.parametrize("argv", [["--replicas", "2"], ["default", "--replicas", "2"]])
def test_the_default_model_is_filled_in_as_serve_does(monkeypatch, argv):
    """`serve --replicas 2` (as docs/cluster.md gives it) and `serve default --replicas 2` serve the
    default model; they used to start replicas of None that Ray restarted until it gave up."""
    assert _started_spec(monkeypatch, argv).replica.model == "default"


def test_a_model_that_is_not_there_is_refused_before_ray_starts(monkeypatch, tmp_path):
    with pytest.raises(ConfigError, match="no model at"):
        _started_spec(monkeypatch, [str(tmp_path / "missing.gguf"), "--replicas", "2"])
    with pytest.raises(ConfigError, match="two models given"):
        _started_spec(monkeypatch, ["default", "--model", "minilm", "--replicas", "2"])


def test_what_the_cluster_cannot_do_is_refused():
    with pytest.raises(ConfigError, match="static"):
        spec_from_args(parse(["--replicas", "2", "--batching", "static"]))
    with pytest.raises(ConfigError, match="replicas must be >= 1"):
        spec_from_args(parse(["--replicas", "0", "--fake-engine"]))


def test_the_embedding_model_reaches_the_spec_and_none_turns_it_off(tmp_path):
    """The ingress serves /v1/embeddings as `scratchllm serve` does: MiniLM unless told otherwise."""
    assert spec_from_args(parse(["--replicas", "2", "--fake-engine"])).embedding_model == "minilm"
    assert spec_from_args(parse(["--replicas", "2", "--model", "default"])).embedding_model == "minilm"
    assert spec_from_args(parse(["--replicas", "2", "--fake-engine", "--embedding-model", "none"])).embedding_model \
        is None
    with pytest.raises(ConfigError, match="no model at"):  # before Ray starts, not in the ingress
        spec_from_args(parse(["--replicas", "2", "--embedding-model", str(tmp_path / "missing")]))


def test_a_deploy_failure_is_the_replica_error_in_one_line():
    from scratchllm.cluster.app import deploy_error

    # the shape of Serve's deployment status message when a replica's constructor raised
    message = ("The deployment failed to start 3 times in a row. This may be due to a problem with its "
               "constructor or initial health check failing. See controller logs for details. Error:\n"
               "\x1b[36mray::ServeReplica:scratchllm:engine.initialize_and_get_metadata()\x1b[39m (pid=1)\n"
               '  File "/x/ray/serve/_private/replica.py", line 1928, in initialize\n'
               "    raise RuntimeError(traceback.format_exc()) from None\n"
               "RuntimeError: Traceback (most recent call last):\n"
               '  File "/x/scratchllm/formats/gguf.py", line 226, in _info\n'
               '    raise FormatError(p, f"tensor ends at byte {start + nbytes} but the file has "\n'
               "scratchllm.errors.FormatError: /m/cut.gguf: tensor 'x' ends at byte 9 but the file has 4 bytes\n")
    assert deploy_error(message) == "FormatError: /m/cut.gguf: tensor 'x' ends at byte 9 but the file has 4 bytes"
    assert deploy_error("Replica failed.\nmore") == "Replica failed."


def test_a_broken_model_header_is_refused_before_ray_starts(monkeypatch, tmp_path):
    """A GGUF cut inside its metadata: the header is read (config, tokenizer) before Ray starts,
    so the command fails with the file's FormatError instead of a deploy that fails in each replica."""
    from scratchllm.errors import FormatError
    from scratchllm.formats.refs import resolve_model

    broken = tmp_path / "cut.gguf"
    broken.write_bytes(resolve_model("default").read_bytes()[:4096])
    with pytest.raises(FormatError, match="cut.gguf"):
        _started_spec(monkeypatch, [str(broken), "--replicas", "2"])
