"""Feedback: request classes, per-class scores and adjustments by hand, and a real Scheduler +
BlockManager whose admission order the priorities file changes (never starving anyone)."""

import json

import pytest

from scratchllm.engine.block_manager import BlockManager
from scratchllm.engine.config import EngineConfig
from scratchllm.engine.request import Priority, Request
from scratchllm.engine.scheduler import Scheduler
from scratchllm.errors import ConfigError
from scratchllm.evaluate.feedback import (
    RequestClasses,
    compute_feedback,
    engine_priority_hook,
    load_priority_hook,
    request_class,
)
from scratchllm.sampling import SamplingParams

from .test_report import scored_store


def test_request_class_keys():
    assert request_class({"prompt": "x", "metadata": {"request_class": "faq"}, "user": "u"}) == "class:faq"
    assert request_class({"prompt": "x", "user": "u1"}) == "user:u1"
    a = request_class({"prompt": "Translate  to French:\nHello"})
    assert a.startswith("prefix:") and len(a) == len("prefix:") + 16
    assert request_class({"prompt": "translate to french: Hello"}) == a  # case and whitespace
    assert request_class({"prompt": "Ｔranslate to French: Hello"}) == a  # NFKC: full-width T
    assert request_class({"prompt": "Summarize: Hello"}) != a
    tail = "x" * 64
    assert request_class({"prompt": tail + " one"}) == request_class({"prompt": tail + " two"})  # prefix only
    chat = {"messages": [{"role": "user", "content": "Hi"}]}
    assert request_class(chat) == request_class({"messages": [{"role": "user", "content": [{"type": "text",
                                                                                           "text": "hi"}]}]})


def test_scores_and_adjustments_by_hand(tmp_path):
    store, _ = scored_store(tmp_path)
    doc = compute_feedback(store, threshold=0.5, max_adjust_s=2.0)
    # class:0 holds diffs 0 and 2: +1 +1 +1 -1 -1 0 -> 3/6 = 0.5, not below the threshold
    # class:1 holds diffs 1 and 3: +1 0 -1 0 0 +1 -> 2/6, lowered by 2 * (0.5 - 1/3) / 0.5 = 2/3 s
    assert doc["classes"]["class:0"] == {"score": 0.5, "num_scores": 6, "adjust_s": 0.0}
    assert doc["classes"]["class:1"]["score"] == pytest.approx(1 / 3)
    assert doc["classes"]["class:1"]["adjust_s"] == pytest.approx(-2 / 3)
    path = tmp_path / "priorities.json"
    path.write_text(json.dumps(doc))
    hook = load_priority_hook(path)
    assert hook("class:1") == pytest.approx(-2 / 3) and hook("class:0") == 0.0 and hook("unknown") == 0.0


@pytest.mark.parametrize("doc, problem", [
    ({"version": 9, "classes": {}}, "not a priorities file"),
    ({"version": 1, "max_adjust_s": 1.0, "classes": {"a": {"adjust_s": -5}}}, "within"),
])
def test_bad_priorities_files(tmp_path, doc, problem):
    path = tmp_path / "p.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ConfigError, match=problem):
        load_priority_hook(path)
    with pytest.raises(ConfigError, match="cannot read"):
        load_priority_hook(tmp_path / "missing.json")


def _low(rid, arrival):
    return Request(rid, [1, 2, 3, 4], SamplingParams(max_tokens=300, temperature=0.0), Priority.LOW, arrival=arrival)


def _admission_order(hook, classes):
    cfg = EngineConfig(max_low_per_tick=1)
    s = Scheduler(cfg, BlockManager(64, cfg.block_size))
    if hook is not None:
        s.priority_hook = hook
    for rid, arrival in (("worse-0", 0.0), ("fine-0", 0.1), ("worse-1", 0.2), ("fine-1", 0.3)):
        s.add(_low(rid, arrival))
    order, now = [], 0.5
    while s.has_waiting():
        order += [r.request_id for r in s.schedule(now=now).admitted]
        now += cfg.tick_s
        assert now < 0.5 + cfg.aging_s + cfg.max_priority_adjust_s, "lowered, yet admitted within the aging bound"
    return order


def test_the_feedback_file_changes_the_admission_order(tmp_path):
    store, _ = scored_store(tmp_path)
    path = tmp_path / "priorities.json"
    path.write_text(json.dumps(compute_feedback(store, max_adjust_s=2.0)))
    classes = {"worse-0": "class:1", "worse-1": "class:1", "fine-0": "class:0", "fine-1": "class:0"}
    hook = engine_priority_hook(load_priority_hook(path), class_of=lambda req: classes.get(req.request_id))
    assert _admission_order(None, classes) == ["worse-0", "fine-0", "worse-1", "fine-1"]  # arrival order
    # class:1 is lowered by 2/3 s: its virtual arrivals 0.67 and 0.87 fall behind 0.1 and 0.3
    assert _admission_order(hook, classes) == ["fine-0", "fine-1", "worse-0", "worse-1"]


def test_request_classes_map_engine_requests_to_their_class():
    classes = RequestClasses()
    assert classes.remember("cmpl-abc", {"prompt": "x", "user": "team-b"}) == "user:team-b"
    assert classes(_low("cmpl-abc", 0.0)) == "user:team-b"
    assert classes(_low("cmpl-abc-1", 0.0)) == "user:team-b"  # the second prompt of that request
    assert classes(_low("other", 0.0)) is None
    hook = engine_priority_hook(lambda key: -1.5 if key == "user:team-b" else 0.0, classes)
    assert hook(_low("cmpl-abc", 0.0)) == -1.5
    classes.forget("cmpl-abc")
    assert hook(_low("cmpl-abc", 0.0)) == 0.0
