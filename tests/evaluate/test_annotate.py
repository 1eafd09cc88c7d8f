"""The annotation API driven by three simulated annotators, and the page in a real browser
(Debian's chromium through Playwright): sign in, score with the keyboard, the next diff shown."""

import os
import shutil
import socket
import threading
import time

import pytest
from fastapi.testclient import TestClient

from scratchllm.evaluate.annotate import candidate_side, create_app
from scratchllm.evaluate.triage import triage_run

from .helpers import make_store, out

CHROMIUM = "/usr/bin/chromium"


def annotated_store(tmp_path):
    same = out(["The", " answer", " is", " 42", "."])
    triples = [(same, same, out(["The", " answer", " is", f" {40 + i}", " maybe"])) for i in range(5)]
    triples += [(same, same, same)] * 2  # identical: never handed out
    triples += [(same, out(["Other"]), out(["Else"]))]  # noisy: primary and secondary differ
    store = make_store(tmp_path, triples)
    triage_run(store)
    return store


def score_all(client, name, value):
    scored = []
    while True:
        diff = client.get("/api/next", params={"annotator": name}).json()["diff"]
        if diff is None:
            return scored
        assert diff["klass"] == "semantic" and diff["your_score"] is None
        r = client.post("/api/score", json={"annotator": name, "request_id": diff["request_id"], "score": value})
        assert r.status_code == 200, r.text
        scored.append(diff["request_id"])


def test_three_annotators_each_diff_scored_three_times(tmp_path):
    store = annotated_store(tmp_path)
    client = TestClient(create_app(store))
    assert client.post("/api/signin", json={"name": "ann"}).json() == {"annotator": "ann"}
    semantic = [d["request_id"] for d in store.diffs() if d["klass"] == "semantic" and not d["noisy"]]
    assert len(semantic) == 5
    for name, value in (("ann", 1), ("bob", 0), ("cy", -1)):
        assert sorted(score_all(client, name, value)) == semantic
    assert score_all(client, "dee", 1) == []  # each diff has its 3 annotators
    rows = store.scores()
    assert len(rows) == 15
    per_diff = {}
    for r in rows:
        per_diff.setdefault(r["request_id"], set()).add(r["annotator"])
        assert r["created"] > 0
    assert all(v == {"ann", "bob", "cy"} for v in per_diff.values())


def test_scoring_rules_and_no_peeking(tmp_path):
    store = annotated_store(tmp_path)
    client = TestClient(create_app(store))
    rid = client.get("/api/next", params={"annotator": "ann"}).json()["diff"]["request_id"]
    # the same diff again until it is scored: the reservation holds
    assert client.get("/api/next", params={"annotator": "ann"}).json()["diff"]["request_id"] == rid
    assert client.post("/api/score", json={"annotator": "ann", "request_id": rid, "score": 1}).status_code == 200
    again = client.post("/api/score", json={"annotator": "ann", "request_id": rid, "score": -1})
    assert again.status_code == 409 and "already scored" in again.json()["detail"]
    assert client.post("/api/score", json={"annotator": "ann", "request_id": rid, "score": 2}).status_code == 422
    identical = next(d["request_id"] for d in store.diffs() if d["klass"] == "identical")
    assert client.post("/api/score", json={"annotator": "ann", "request_id": identical, "score": 1}).status_code == 404
    view = client.get(f"/api/diff/{rid}", params={"annotator": "bob"}).json()
    assert view["your_score"] is None and "scores" not in view and "score" not in view
    assert client.get(f"/api/diff/{rid}", params={"annotator": "ann"}).json()["your_score"] == 1
    assert view["primary"] == "The answer is 42." and view["candidate"].startswith("The answer is 4")
    assert view["common_prefix_chars"] == len("The answer is 4")
    assert client.get("/api/diff/9999").status_code == 404


class _Server:
    def __init__(self, app):
        import uvicorn

        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        sock.close()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        return f"http://127.0.0.1:{self.port}"

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(10)


@pytest.mark.skipif(not os.path.exists(CHROMIUM) and shutil.which("chromium") is None, reason="chromium not installed")
def test_the_page_in_a_real_browser(tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api")
    store = annotated_store(tmp_path)
    with _Server(create_app(store)) as url, sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=[
            "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--disable-component-update", "--disable-sync", "--no-first-run"])
        try:
            page = browser.new_page(viewport={"width": 1200, "height": 640})
            page.goto(url + "/")
            page.fill("#name", "ann")
            page.press("#name", "Enter")
            page.wait_for_selector("#work:not(.hidden)")
            first = int(page.text_content("#diff-id"))
            assert page.text_content("#klass") == "semantic"
            cand, prim = ("#right", "#left") if candidate_side("ann", first) == "right" else ("#left", "#right")
            assert page.text_content(f"{prim} mark") == "2."  # the divergence is highlighted
            assert page.text_content(f"{cand} mark") == "0 maybe"
            shot = os.environ.get("SCRATCHLLM_ANNOTATE_SCREENSHOT", str(tmp_path / "annotate.png"))
            page.screenshot(path=shot)
            page.keyboard.press("3")  # B (the right column) is better
            page.wait_for_function(f"document.getElementById('diff-id').textContent !== '{first}'")
            assert page.text_content("#status") == f"stored for diff {first}"
            expected = 1 if cand == "#right" else -1  # +1 exactly when the candidate is B
            assert [(r["request_id"], r["annotator"], r["score"]) for r in store.scores()] == [(first, "ann", expected)]
            second = int(page.text_content("#diff-id"))
            page.keyboard.press("2")
            page.wait_for_function("document.getElementById('progress').textContent === '2 scored'")
            assert {r["request_id"]: r["score"] for r in store.scores()} == {first: expected, second: 0}
            with open(shot, "rb") as f:
                assert f.read(8) == b"\x89PNG\r\n\x1a\n"
        finally:
            browser.close()


def test_a_reservation_keeps_a_fourth_annotator_out_until_it_lapses(tmp_path):
    from scratchllm.evaluate.annotate import RESERVE_S, Annotation

    store = annotated_store(tmp_path)
    now = [1000.0]
    ann = Annotation(store, clock=lambda: now[0])
    first = ann.next_for("ann")
    for name in ("ann", "bob"):
        assert ann.next_for(name) == first
        ann.score(name, first, 1)
    assert ann.next_for("cy") == first  # its third annotator, reserved
    assert ann.next_for("dee") != first  # not a fourth while cy holds it
    now[0] += RESERVE_S + 1
    assert ann.next_for("eve") == first  # cy's reservation lapsed


def test_the_candidate_side_is_a_fixed_fair_coin():
    sides = [candidate_side(name, rid) for name in ("ann", "bob", "cy") for rid in range(200)]
    assert 0.4 < sides.count("right") / len(sides) < 0.6
    assert candidate_side("ann", 7) == candidate_side("ann", 7)


def test_a_run_with_nothing_to_score_says_why(tmp_path):
    from scratchllm.errors import ConfigError
    from scratchllm.evaluate.annotate import open_run

    same, other = out(["x"]), out(["y"])
    store = make_store(tmp_path, [(same, same, same), (same, other, other)])
    with pytest.raises(ConfigError) as err:
        open_run(store.path)
    text = str(err.value)
    assert "no diff to annotate in the classes semantic" in text
    assert "identical 1" in text and "semantic 0 (+1 noisy)" in text and "--classes" in text


def test_annotate_on_a_port_in_use_is_one_clear_error(tmp_path, capsys):
    """A second `eval annotate` used to print its URL and then die with 'address already in use'."""
    from scratchllm.cli.main import main

    same, other = out(["x"]), out(["y"])
    store = make_store(tmp_path, [(same, same, other)])
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    try:
        assert main(["eval", "annotate", str(store.path), "--port", str(port)]) == 2
    finally:
        busy.close()
    err = capsys.readouterr().err
    assert f"scratchllm eval annotate cannot listen on 127.0.0.1:{port}" in err and "pick another --port" in err
    assert "annotation page:" not in err
