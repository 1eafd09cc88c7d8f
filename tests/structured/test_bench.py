"""`bench structured` runs and reports its figures (a short walk, no model)."""

import argparse

from scratchllm.bench import structured


def test_mask_walk_reports_per_token_costs():
    parser = argparse.ArgumentParser()
    structured.add_arguments(parser)
    result = structured.run(parser.parse_args(["--walk", "3"]))
    m = result["mask"]
    assert m["tokens"] >= 50 and m["compute_us_median"] > 0 and m["apply_us_median"] > 0
    assert "mask per token" in structured.render(result) and "engine" not in result
