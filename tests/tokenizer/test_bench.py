"""`scratchllm bench tokenizer` on a small corpus: it runs, compares ids, and prints the ratio."""

import argparse

import pytest

from scratchllm.bench import tokenizer as bench

pytest.importorskip("tokenizers")


@pytest.mark.parametrize("model", ["default", "minilm"])
def test_bench_runs_and_reports_ratio(model):
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    result = bench.run(parser.parse_args(["--model", model, "--mb", "0.05", "--repeat", "1"]))
    assert result["figures"]["ids_equal"] is True
    assert result["inputs"]["corpus_bytes"] > 40_000 and result["inputs"]["tokens"] > 5_000
    assert set(result["inputs"]["categories"]) == {"prose", "code", "multilingual"}
    ratio = result["ratios"]["warm_ours_over_tokenizers"]
    assert ratio == pytest.approx(result["figures"]["warm_mb_s"]["ours"] / result["figures"]["warm_mb_s"]["tokenizers"])
    text = bench.render(result)
    assert "ratio ours / tokenizers" in text and "ids identical to tokenizers: yes" in text
