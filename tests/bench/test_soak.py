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
