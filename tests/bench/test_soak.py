"""`scratchllm bench soak` for 20 s on the fake engine (what CI runs; the default model's 30-minute
run is in docs/soak.md): no 5xx, no leaked KV block, flat file descriptors and threads."""

import json

import pytest

from scratchllm.bench.soak import check, render
from scratchllm.cli.main import main


@pytest.mark.slow
def test_short_soak_on_the_fake_engine_keeps_every_promise(tmp_path, capsys):
    assert main(["bench", "soak", "--fake-engine", "--minutes", "0.33", "--sample-s", "2", "--json",
                 "--plot", str(tmp_path / "soak.png")]) == 0
    result = json.loads(capsys.readouterr().out)
    c = result["counts"]
    assert result["problems"] == [] == check(result), render(result)
    assert result["http_5xx"] == 0 and result["leaked_kv_blocks"] == 0
    # every kind of the mix happened, and each was answered as it should be
    for kind in ("completed", "disconnected", "aborted_by_client", "hostile", "trickled", "bursts"):
        assert c.get(kind, 0) > 0, (kind, c)
    assert c["http_429"] > 0  # the bursts went over the admission bound
    assert c["http_400"] > 0 and c["http_400"] <= c["hostile"]
    first, last = result["samples"][0], result["samples"][-1]
    assert first["fds"] > 0 and last["fds"] <= first["fds"] + 4 and last["threads"] <= first["threads"] + 2
    assert (tmp_path / "soak.png").stat().st_size > 10_000


def test_the_rss_promise_is_weights_plus_twice_the_peak_kv():
    from scratchllm.bench.soak import RSS_SLACK_BYTES, check, rss_figures

    def sample(t, rss):
        return {"t_s": t, "rss_mb": rss, "fds": 10, "threads": 5, "kv_blocks_used": 0, "in_flight": 0,
                "requests": 0, "http_5xx": 0}

    result = {"seconds": 480.0, "counts": {}, "http_5xx": 0, "leaked_kv_blocks": 0,
              "peak_kv_bytes": 30 * 2**20, "samples": [sample(0, 150), sample(30, 900), sample(90, 300),
                                                        sample(400, 310)]}
    result.update(rss_figures(result, 100 * 2**20))
    # the warm-up's first minute (900 MiB at 30 s) is not counted; after it, 310 MiB
    assert result["rss_after_warmup_mib"] == 310 and result["rss_bound_mib"] == 100 + 60 + RSS_SLACK_BYTES / 2**20
    assert any("RSS after the warm-up reached 310 MiB" in p for p in check(result))
    result.update(rss_figures(result, 200 * 2**20))
    assert not check(result)
    assert rss_figures(result, None)["rss_bound_mib"] is None  # the fake engine: no weights, no promise
