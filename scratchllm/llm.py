"""`LLM`: the one-line way to run a model. `LLM("default").generate(["Hi"], SamplingParams(...))`.

For now each request runs alone, a prefill then one decode step per token over a
ContiguousKVCache; the batched, paged engine (scratchllm.engine) will take over `generate`
behind the same surface. What stays here either way: resolve model + tokenizer, chat
templates, stop conditions and the RequestOutput.

A request finishes for one of two reasons:
  "stop"   - an end token (the tokenizer's EOS unless ignore_eos, or one of stop_token_ids), or
             one of the stop strings appeared in the text (the text is cut before it);
  "length" - max_tokens generated, or the model's context is full.
"""

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from scratchllm.errors import ConfigError
from scratchllm.models import ContiguousKVCache, load_model
from scratchllm.sampling import SamplingParams, make_rng, sample_token, top_logprobs

_request_ids = itertools.count()


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # "stop" | "length"
    metrics: dict = field(default_factory=dict)  # prompt_tokens, completion_tokens, prefill_s, decode_s, ...
    logprobs: list | None = None  # per token: (logprob, [(id, logprob), ...]) when params.logprobs is set


class LLM:
    """A model and its tokenizer, ready to generate.

    `model`: "default", a .gguf file or a Hugging Face folder (see SPEC, model references).
    `tokenizer`: where the tokenizer lives when it is not beside the weights.
    `max_model_len`: the longest prompt + completion (default: the model's context).
    `threads`: BLAS threads for this process (default: leave as is). 1 is often faster on a
    machine whose cores other jobs share; see scratchllm/models/threads.py.
    """

    OPTIONS = ("tokenizer", "max_model_len", "threads")

    def __init__(self, model="default", **engine_options):
        unknown = sorted(set(engine_options) - set(self.OPTIONS))
        if unknown:
            raise ConfigError(f"unknown LLM option(s) {', '.join(unknown)}; known: {', '.join(self.OPTIONS)}")
        from scratchllm.tokenizer import Tokenizer

        if engine_options.get("threads") is not None:
            from scratchllm.models.threads import set_blas_threads

            if int(engine_options["threads"]) < 1:
                raise ConfigError(f"threads must be >= 1, got {engine_options['threads']}")
            set_blas_threads(int(engine_options["threads"]))
        start = time.perf_counter()
        self.model = load_model(model)
        if not self.model.config.is_decoder:
            kind = self.model.config.model_type
            raise ConfigError(f"'{model}' is an encoder ({kind}): it embeds, it does not generate")
        self.tokenizer = Tokenizer.from_pretrained(engine_options.get("tokenizer") or model)
        self.load_s = time.perf_counter() - start
        self.max_model_len = int(engine_options.get("max_model_len") or self.model.config.max_position_embeddings)
        eos = self.tokenizer.eos_token_id
        self.eos_token_id = eos if eos is not None else self.model.config.eos_token_id

    # ---- prompts ------------------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict]) -> str:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)

    def chat(self, messages: list[dict], params: SamplingParams | None = None, on_token=None) -> RequestOutput:
        """One conversation turn: the chat template renders the messages, the model answers."""
        prompt = self.apply_chat_template(messages)
        # the template writes its own special tokens (BOS included) as text
        ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        return self.run(ids, params or SamplingParams(), prompt=prompt, on_token=on_token)

    def generate(self, prompts, params: SamplingParams | None = None) -> list[RequestOutput]:
        """prompts: a string, a list of strings, or token ids (one list[int] or a list of them)."""
        params = params or SamplingParams()
        if isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        outputs = []
        for prompt in prompts:
            if isinstance(prompt, str):
                outputs.append(self.run(self.tokenizer.encode(prompt), params, prompt=prompt))
            else:
                outputs.append(self.run([int(t) for t in prompt], params))
        return outputs

    # ---- one request --------------------------------------------------------------------------
    def run(self, prompt_ids: list[int], params: SamplingParams, prompt: str | None = None,
            on_token: Callable[[int, str], None] | None = None) -> RequestOutput:
        """Prefill, then decode until a stop condition. `on_token(id, text_delta)` streams: the
        delta holds back text that could still turn out to be the start of a stop string."""
        if not prompt_ids:
            raise ConfigError("the prompt is empty: there is nothing to continue from")
        if len(prompt_ids) >= self.max_model_len:
            raise ConfigError(f"the prompt has {len(prompt_ids)} tokens; the model's context is {self.max_model_len}")
        out = RequestOutput(request_id=str(next(_request_ids)), prompt=prompt, prompt_token_ids=list(prompt_ids),
                            logprobs=[] if params.logprobs is not None else None)
        capacity = min(len(prompt_ids) + params.max_tokens, self.max_model_len)
        cache = ContiguousKVCache.for_model(self.model.config, capacity)
        end_ids = set(params.stop_token_ids) | ({self.eos_token_id} if not params.ignore_eos else set())
        end_ids.discard(None)
        rng = make_rng(params)
        detok = self.tokenizer.detokenizer()
        hold = max((len(s) for s in params.stop), default=1) - 1  # chars that might begin a stop string
        streamed = 0

        t0 = time.perf_counter()
        n = len(prompt_ids)
        logits = self.model.forward(np.asarray(prompt_ids), np.arange(n), cache, logits_rows=[n - 1])[-1]
        t1 = time.perf_counter()
        while True:
            token = sample_token(logits, params, rng)
            out.token_ids.append(token)
            if out.logprobs is not None:
                out.logprobs.append(top_logprobs(logits, token, params.logprobs))
            if token in end_ids:
                out.finish_reason = "stop"
                break
            seen = max(0, len(out.text) - hold)  # a stop string can only end in the new text
            out.text += detok.push(token)
            cut = min((i for i in (out.text.find(s, seen) for s in params.stop) if i >= 0), default=-1)
            if cut >= 0:
                out.text, out.finish_reason = out.text[:cut], "stop"
                break
            if len(out.token_ids) >= params.max_tokens or n + len(out.token_ids) >= self.max_model_len:
                out.finish_reason = "length"
                break
            if on_token is not None and len(out.text) - hold > streamed:
                on_token(token, out.text[streamed : len(out.text) - hold])
                streamed = len(out.text) - hold
            logits = self.model.forward(np.array([token]), np.array([cache.length]), cache)[-1]
        if on_token is not None:
            on_token(out.token_ids[-1], out.text[streamed:])  # the rest, stop strings excluded
        t2 = time.perf_counter()
        decoded = len(out.token_ids) - 1  # the first token comes from the prefill's logits
        out.metrics = {
            "prompt_tokens": n, "completion_tokens": len(out.token_ids),
            "prefill_s": t1 - t0, "decode_s": t2 - t1, "ttft_s": t1 - t0,
            "prefill_tok_s": n / (t1 - t0), "decode_tok_s": decoded / (t2 - t1) if decoded else None,
        }
        return out
