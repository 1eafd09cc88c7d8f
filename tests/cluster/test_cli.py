"""`scratchllm serve --replicas N`: the serve command's options become the cluster's spec, and
what the cluster cannot do is refused before Ray starts."""

import argparse

import pytest

from scratchllm.cli import serve_cmd
from scratchllm.errors import ConfigError

pytest.importorskip("ray", reason="the cluster extra (ray[serve]) is not installed")
from scratchllm.cluster.cli import spec_from_args


def parse(argv):
    parser = argparse.ArgumentParser()
    serve_cmd.add_parser(parser.add_subparsers())
    return parser.parse_args(["serve", *argv])


def test_the_fake_engine_and_the_servers_limits_reach_the_spec():
    spec = spec_from_args(parse(["--replicas", "3", "--fake-engine", "--max-num-seqs", "5", "--fake-step-ms", "7",
                                 "--max-in-flight", "9", "--num-kv-blocks", "200"]))
    assert spec.replicas == 3 and spec.replica.fake and spec.server.max_in_flight == 9
    assert spec.replica.engine_options == {"max_running": 5, "step_ms": 7.0, "max_model_len": 2048, "num_blocks": 200}


def test_a_model_replica_gets_the_engine_options():
    spec = spec_from_args(parse(["--replicas", "2", "--model", "default", "--max-num-seqs", "4", "--policy", "fcfs"]))
    assert spec.replica.model == "default" and spec.replica.engine_options == {"max_num_seqs": 4, "policy": "fcfs"}


def test_what_the_cluster_cannot_do_is_refused():
    with pytest.raises(ConfigError, match="static"):
        spec_from_args(parse(["--replicas", "2", "--batching", "static"]))
    with pytest.raises(ConfigError, match="replicas must be >= 1"):
        spec_from_args(parse(["--replicas", "0", "--fake-engine"]))
