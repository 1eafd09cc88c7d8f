"""The report's numbers against hand computation: rates and their Wilson intervals, Fleiss'
kappa, the alpha's data layout, latency deltas, the worst regressions and their links."""

import json
import math

import krippendorff
import pytest

from scratchllm.evaluate.agreement import wilson
from scratchllm.evaluate.report import build_report, write_report
from scratchllm.evaluate.triage import triage_run

from .helpers import make_store, out

SCORES = {0: (1, 1, 1), 1: (1, 0, -1), 2: (-1, -1, 0), 3: (0, 0, 1)}  # per diff: ann, bob, cy


def scored_store(tmp_path):
    same = out(["a", " b", " c"], latency_ms=10.0)
    triples = [(same, out(["a", " b", " c"], latency_ms=12.0), out(["x", f" {i}"], latency_ms=15.0 + i))
               for i in range(4)]
    triples.append((same, same, same))
    store = make_store(tmp_path, triples)
    triage_run(store)
    ids = [d["request_id"] for d in store.diffs()]
    for k, values in SCORES.items():
        for name, v in zip(("ann", "bob", "cy"), values, strict=True):
            store.execute("INSERT INTO score VALUES (?, ?, ?, ?)", (ids[k], name, v, 1.0 + k))
    return store, ids


def test_report_numbers_equal_hand_computation(tmp_path):
    store, ids = scored_store(tmp_path)
    r = build_report(store, annotate_url="http://ann:9/")
    s = r["scores"]
    assert (s["improvement"]["count"], s["neutral"]["count"], s["harm"]["count"], s["total"]) == (5, 4, 3, 12)
    assert s["improvement"]["rate"] == 5 / 12 and s["improvement"]["wilson95"] == list(wilson(5, 12))
    # Fleiss by hand: P_i = 1, 0, 1/3, 1/3 -> P = 5/12; p = 3/12, 4/12, 5/12 -> Pe = 50/144; kappa = 5/47
    assert r["agreement"]["fleiss_kappa"] == pytest.approx(5 / 47)
    rows = [[SCORES[k][a] for k in range(4)] for a in range(3)]  # coders x units
    expected = krippendorff.alpha(reliability_data=rows, value_domain=[-1, 0, 1], level_of_measurement="ordinal")
    assert r["agreement"]["krippendorff_alpha_ordinal"] == pytest.approx(expected)
    assert r["agreement"]["annotators"] == 3 and r["agreement"]["scored_diffs"] == 4
    lat = r["latency"]
    assert lat["candidate_minus_primary_ms"]["mean"] == pytest.approx((5 + 6 + 7 + 8 + 0) / 5)
    assert lat["secondary_minus_primary_ms"]["mean"] == pytest.approx((2 * 4 + 0) / 5)
    worst = r["worst_regressions"]
    assert [(w["request_id"], w["mean_score"]) for w in worst] == [(ids[2], -2 / 3)]
    assert worst[0]["link"] == f"http://ann:9/#/diff/{ids[2]}"
    assert r["triage"]["classes"]["semantic"]["net"] == 4


def test_report_files(tmp_path):
    store, ids = scored_store(tmp_path)
    write_report(store, tmp_path / "r.html", tmp_path / "r.json")
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["scores"]["harm"]["count"] == 3
    html = (tmp_path / "r.html").read_text()
    assert f"#/diff/{ids[2]}" in html and "41.7%" in html  # 5 of 12


def test_report_without_scores(tmp_path):
    same = out(["a"])
    store = make_store(tmp_path, [(same, same, same)])
    triage_run(store)
    r = build_report(store)
    assert r["scores"]["improvement"]["rate"] is None and r["agreement"]["krippendorff_alpha_ordinal"] is None
    assert not math.isnan(r["latency"]["candidate_minus_primary_ms"]["mean"])


def test_the_report_reads_as_the_annotation_page_does(tmp_path):
    """Special tokens are not shown as text, answers cut at max_tokens are marked, a link is
    labelled with the diff it opens (the page's 'Diff N'), and the candidate's change is named."""
    same = out(["The", " answer", "<|im_end|>"], finish_reason="stop")
    cut = out(["A", " long", " answer"])  # the helper's outputs end at max_tokens ("length")
    store = make_store(tmp_path, [(same, same, same), (same, same, cut)])
    store.set_option("change", "int8 KV cache")
    triage_run(store)
    (diff,) = [d for d in store.diffs() if d["klass"] == "semantic"]
    store.execute("INSERT INTO score VALUES (?, ?, ?, ?)", (diff["request_id"], "ann", -1, 1.0))
    r = build_report(store)
    (worst,) = r["worst_regressions"]
    assert "<|im_end|>" not in worst["context_primary"] and worst["context_primary"] == "⟦The answer"
    assert (worst["cut_primary"], worst["cut_candidate"]) == (False, True)
    assert r["change"] == "int8 KV cache"
    write_report(store, tmp_path / "r.html", tmp_path / "r.json")
    html = (tmp_path / "r.html").read_text()
    assert f'#/diff/{diff["request_id"]}">diff {diff["request_id"]}</a> (request #{diff["idx"]})' in html
    assert "int8 KV cache" in html and "<i>cut</i>" in html and "marked <b>⟦</b>" in html
