"""Loading: `LLM` and `LLMEngine.from_pretrained` parse a GGUF's header once for the model and
its tokenizer, and what they build equals what the separate loaders build."""

import pytest

from scratchllm import LLM, Tokenizer
from scratchllm.engine import LLMEngine
from scratchllm.errors import ConfigError, FormatError
from scratchllm.formats import gguf as gguf_module
from scratchllm.formats import load_checkpoint
from scratchllm.models import load_model


@pytest.fixture
def parses(monkeypatch):
    """The paths of every GGUF header parsed while the test runs."""
    seen = []
    real = gguf_module.GGUFFile.__init__

    def counting(self, path):
        seen.append(str(path))
        real(self, path)

    monkeypatch.setattr(gguf_module.GGUFFile, "__init__", counting)
    return seen


@pytest.mark.slow
def test_llm_parses_the_file_once(parses, default_gguf):
    llm = LLM("default", threads=1, num_kv_blocks=8)
    assert parses == [str(default_gguf)]
    alone = Tokenizer.from_pretrained("default")  # the tokenizer read on its own, from the file
    text = "Hello world! 123 <|im_start|>user\nQuoi de neuf ?<|im_end|>"
    assert llm.tokenizer.encode(text) == alone.encode(text)
    assert llm.tokenizer.vocab_size == alone.vocab_size and llm.eos_token_id == alone.eos_token_id


@pytest.mark.slow
def test_engine_from_pretrained_parses_the_file_once(parses, default_gguf):
    engine = LLMEngine.from_pretrained("default", num_kv_blocks=8)
    assert parses == [str(default_gguf)] and engine.tokenizer is not None


def test_a_tokenizer_from_another_file_does_not_read_the_checkpoint(default_gguf, tmp_path):
    # A checkpoint of another file is ignored: the tokenizer comes from the file it names.
    other = tmp_path / "other.gguf"
    other.write_bytes(b"")  # empty: reading it fails, naming it
    with pytest.raises(FormatError, match="other.gguf.*empty file"):
        Tokenizer.from_pretrained(other, checkpoint=load_checkpoint(default_gguf))


def test_load_model_refuses_the_checkpoint_of_another_file(default_gguf, minilm_dir):
    with pytest.raises(ConfigError, match="another file"):
        load_model(minilm_dir, checkpoint=load_checkpoint(default_gguf))


def test_the_static_backend_parses_the_file_once(parses, default_gguf):
    from scratchllm.server.backend import _load_static

    served = _load_static("default", "m", {"max_num_seqs": 2, "max_model_len": 64}, "auto")
    assert parses == [str(default_gguf)]
    assert served.tokenizer.encode("Hello") == Tokenizer.from_pretrained("default").encode("Hello")


def test_the_cluster_ingress_parses_the_file_once(parses, default_gguf):
    pytest.importorskip("ray")
    from scratchllm.cluster.app import ClusterSpec, _served_model
    from scratchllm.cluster.replica import ReplicaSpec

    class Handle:  # stands in for Serve's DeploymentHandle: nothing is sent here
        def options(self, **_):
            return self

    served = _served_model(ClusterSpec(replica=ReplicaSpec(model="default")), engine_handle=Handle())
    assert parses == [str(default_gguf)] and served.tokenizer.eos_token_id is not None


def test_bench_engine_parses_the_file_once(parses, default_gguf):
    import argparse

    from scratchllm.bench import engine as bench_engine

    parser = argparse.ArgumentParser()
    bench_engine.add_arguments(parser)
    args = parser.parse_args(["--model", "default", "--skip", "mixed,decode", "--chat-new-tokens", "1"])
    result = bench_engine.run(args)
    assert parses == [str(default_gguf)] and result["figures"]["chat"]["sequences"] == 16
