"""Outputs and run files built by hand, for the evaluation tests."""

from scratchllm.evaluate.store import ROLES, Output, RunStore


def out(tokens, top=None, logprobs=None, text=None, **kw) -> Output:
    """An Output whose text is its tokens joined (unless given); top-k defaults to the token alone."""
    top = top if top is not None else [[(t, -0.1)] for t in tokens]
    logprobs = logprobs if logprobs is not None else [dict(t).get(tok, -5.0)
                                                      for tok, t in zip(tokens, top, strict=True)]
    return Output(text="".join(tokens) if text is None else text, tokens=list(tokens), logprobs=logprobs,
                  top_logprobs=top, finish_reason=kw.pop("finish_reason", "length"),
                  latency_ms=kw.pop("latency_ms", 10.0), status=200, **kw)


def make_store(tmp_path, triples, bodies=None, name="run.sqlite") -> RunStore:
    """A run file holding (primary, secondary, candidate) outputs per request, not yet triaged."""
    store = RunStore(tmp_path / name, create=True)
    store.create_run("capture", "http://p", "http://s", "http://c", {})
    for i, outs in enumerate(triples):
        body = bodies[i] if bodies else {"model": "m", "prompt": f"prompt {i}"}
        rid = store.add_request(i, "/v1/completions", f"capture:{i + 1}", body, body, f"class:{i % 2}")
        for role, o in zip(ROLES, outs, strict=True):
            store.put_output(rid, role, o)
    return store
