"""Outputs and run files built by hand, for the evaluation tests."""

from scratchllm.evaluate.store import Output


def out(tokens, top=None, logprobs=None, text=None, **kw) -> Output:
    """An Output whose text is its tokens joined (unless given); top-k defaults to the token alone."""
    top = top if top is not None else [[(t, -0.1)] for t in tokens]
    logprobs = logprobs if logprobs is not None else [dict(t)[tok] if tok in dict(t) else -5.0
                                                      for tok, t in zip(tokens, top, strict=True)]
    return Output(text="".join(tokens) if text is None else text, tokens=list(tokens), logprobs=logprobs,
                  top_logprobs=top, finish_reason="length", latency_ms=kw.pop("latency_ms", 10.0), status=200, **kw)
