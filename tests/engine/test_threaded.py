"""The threaded-engine skeleton (engine/threaded.py) the continuous, static and fake engines share:
shutdown without drain aborts every open request under the condition, and a thread that ends
leaves no stream without its last event."""

from scratchllm.engine.threaded import ThreadedEngine
from scratchllm.sampling import SamplingParams


class Minimal(ThreadedEngine):
    """Opens streams and ends its thread once `leave_after` are open, delivering nothing itself."""

    def __init__(self, leave_after: int) -> None:
        super().__init__("t", "minimal-engine")
        self.leave_after, self.aborted, self.lock_held = leave_after, [], []
        self._start()

    def submit(self, prompt_token_ids, params, request_id=None):
        with self._cv:
            stream = self._streams.open(request_id)
            self._cv.notify()
        return stream

    def abort(self, request_id):
        self.aborted.append(request_id)
        self.lock_held.append(self._cv._is_owned())  # shutdown calls it under the condition

    def _loop(self):
        with self._cv:
            while len(self._streams) < self.leave_after and not self._stopping:
                self._cv.wait()


def test_a_thread_that_ends_ends_every_open_stream():
    engine = Minimal(leave_after=2)
    streams = engine.submit_group([1, 2], [SamplingParams(), SamplingParams()], ["a", "b"])
    engine._thread.join(timeout=10)
    assert not engine._thread.is_alive()
    for s in streams:
        events = list(s)
        assert [e.finish_reason for e in events] == ["abort"]
    assert engine.finished["abort"] == 2


def test_shutdown_without_drain_aborts_every_open_request_under_the_condition():
    engine = Minimal(leave_after=99)
    streams = [engine.submit([1], SamplingParams(), rid) for rid in ("x", "y", "z")]
    engine.shutdown(drain=False)
    assert sorted(engine.aborted) == ["x", "y", "z"] and all(engine.lock_held)
    assert [list(s)[-1].finish_reason for s in streams] == ["abort"] * 3  # the thread's end closed them
    assert not engine._thread.is_alive()


def test_a_failed_fake_step_aborts_its_requests_and_the_engine_goes_on(monkeypatch):
    """The fake draws through the sampling path now: an error there ends that step's requests
    with "abort", as the continuous and static engines do, and the next request is served."""
    import scratchllm.engine.fake as fake

    real, calls = fake.sample, []

    def fails_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("a step that fails")
        return real(*args, **kwargs)

    monkeypatch.setattr(fake, "sample", fails_once)
    engine = fake.FakeEngine(step_ms=0.5)
    try:
        params = SamplingParams(max_tokens=3, temperature=0.0)
        assert [e.finish_reason for e in engine.submit([5, 6], params)][-1] == "abort"
        events = list(engine.submit([5, 6], params))
        assert len(events) == 3 and events[-1].finish_reason == "length"
    finally:
        engine.shutdown()
