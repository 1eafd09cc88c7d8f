"""`LLM`: the one-line way to run a model. `LLM("default").generate(["Hi"], SamplingParams(...))`.

LLM resolves the model and its tokenizer, applies chat templates and shapes the results; the
work itself runs on the engine (scratchllm.engine): many prompts are batched continuously over
the paged KV cache, and greedy outputs equal each prompt run alone (tests/engine).

Two ways to drive the engine, never both at once:
  - `generate` / `chat` / `run` step the engine in the caller's thread until their requests finish;
  - `submit` starts the engine's own thread (AsyncEngine) for streaming from any thread; from then
    on every call goes through that thread, since only one thread may touch the engine.

A request finishes for one of two reasons:
  "stop"   - an end token (the tokenizer's EOS unless ignore_eos, or one of stop_token_ids), or
             one of the stop strings appeared in the text (the text is cut before it);
  "length" - max_tokens generated, or the model's context is full.
"""

import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from scratchllm.engine import EngineConfig, LLMEngine
from scratchllm.errors import ConfigError
from scratchllm.models import load_model
from scratchllm.sampling import SamplingParams

_ENGINE_OPTIONS = {f.name for f in dataclasses.fields(EngineConfig)}


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    metrics: dict = field(default_factory=dict)  # prompt_tokens, completion_tokens, queue/prefill/decode, tok/s
    logprobs: list | None = None  # per token: (logprob, [(id, logprob), ...]) when params.logprobs is set


class LLM:
    """A model, its tokenizer and an engine, ready to generate.

    `model`: "default", a .gguf file or a Hugging Face folder (see SPEC, model references).
    `tokenizer`: where the tokenizer lives when it is not beside the weights.
    `max_model_len`: the longest prompt + completion (default: the model's context).
    `threads`: matmul (and BLAS) threads for this process (default: leave as is). 1 is often
    faster on a machine whose cores other jobs share; see scratchllm/models/threads.py.
    `dtype`: "auto" (default: "quantized" for a Llama GGUF file with quantized blocks, else
    "float32"), "float32" (the reference's numbers), "bfloat16" (faster matmuls, logits
    that differ in the third digit) or "quantized" (a GGUF file's quantized blocks kept as they
    are: a third of the bytes, float32's logits bit for bit); see scratchllm/models/packed.py.
    Every other option is an EngineConfig field (num_kv_blocks, max_num_seqs, ...).
    """

    OPTIONS = ("tokenizer", "max_model_len", "threads", "dtype", *sorted(_ENGINE_OPTIONS - {"max_model_len"}))

    def __init__(self, model="default", **options):
        unknown = sorted(set(options) - set(self.OPTIONS))
        if unknown:
            raise ConfigError(f"unknown LLM option(s) {', '.join(unknown)}; known: {', '.join(self.OPTIONS)}")
        from scratchllm.tokenizer import Tokenizer

        threads = options.get("threads")
        if threads is not None:
            from scratchllm.models.threads import set_blas_threads

            if int(threads) < 1:
                raise ConfigError(f"threads must be >= 1, got {threads}")
            set_blas_threads(int(threads))
        start = time.perf_counter()
        self.model = load_model(model, dtype=options.get("dtype") or "auto")
        if not self.model.config.is_decoder:
            kind = self.model.config.model_type
            raise ConfigError(f"'{model}' is an encoder ({kind}): it embeds, it does not generate")
        self.tokenizer = Tokenizer.from_pretrained(options.get("tokenizer") or model)
        eos = self.tokenizer.eos_token_id
        self.eos_token_id = eos if eos is not None else self.model.config.eos_token_id
        engine_options = {k: v for k, v in options.items() if k in _ENGINE_OPTIONS}
        if threads is not None:
            engine_options.setdefault("num_threads", int(threads))
        self.engine = LLMEngine(self.model, EngineConfig(**engine_options), tokenizer=self.tokenizer,
                                eos_token_id=self.eos_token_id)
        self.max_model_len = self.engine.max_model_len
        self.load_s = time.perf_counter() - start
        self._async = None
        self._lock = threading.Lock()  # one caller at a time steps the engine

    # ---- prompts ------------------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict]) -> str:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)

    def chat(self, messages: list[dict], params: SamplingParams | None = None, on_token=None) -> RequestOutput:
        """One conversation turn: the chat template renders the messages, the model answers."""
        prompt = self.apply_chat_template(messages)
        # the template writes its own special tokens (BOS included) as text
        ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        return self.run(ids, params or SamplingParams(), prompt=prompt, on_token=on_token)

    def generate(self, prompts, params: SamplingParams | Sequence[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """prompts: a string, a list of strings, or token ids (one list[int] or a list of them).
        params: one SamplingParams for all, or one per prompt. All prompts run batched."""
        params = params or SamplingParams()
        if isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        texts = [p if isinstance(p, str) else None for p in prompts]
        ids = [self.tokenizer.encode(p) if isinstance(p, str) else [int(t) for t in p] for p in prompts]
        per_prompt = [params] * len(ids) if isinstance(params, SamplingParams) else list(params)
        if len(per_prompt) != len(ids):
            raise ConfigError(f"{len(ids)} prompts but {len(per_prompt)} SamplingParams")
        for i, p in zip(ids, per_prompt, strict=True):
            self.engine.validate(i, p)  # refuse a bad prompt before any work starts
        if self._async is not None:
            streams = [self._async.submit(i, p) for i, p in zip(ids, per_prompt, strict=True)]
            results = [self._collect(s, p) for s, p in zip(streams, per_prompt, strict=True)]
        else:
            with self._lock:
                results = self.engine.generate(ids, per_prompt)
        return [self._output(r, t, i) for r, t, i in zip(results, texts, ids, strict=True)]

    def run(self, prompt_ids: list[int], params: SamplingParams, prompt: str | None = None,
            on_token: Callable[[int, str], None] | None = None) -> RequestOutput:
        """One request to completion. `on_token(id, text_delta)` streams: the delta holds back
        text that could still turn out to be the start of a stop string."""
        self.engine.validate(prompt_ids, params)
        result = {"request_id": None, "token_ids": [], "text": "", "finish_reason": None, "metrics": None,
                  "logprobs": [] if params.logprobs is not None else None}
        if self._async is not None:
            events = self._async.submit(prompt_ids, params)
            result["request_id"] = events.request_id
            for e in events:
                self._add_event(result, e.token_id, e.text, e.logprob, e.top_logprobs, e.finish_reason, e.metrics)
                if on_token is not None and e.token_id is not None:
                    on_token(e.token_id, e.text)
        else:
            with self._lock:
                req = self.engine.add_request(None, prompt_ids, params)
                result["request_id"] = req.request_id
                while result["finish_reason"] is None:
                    for o in self.engine.step():
                        if o.request_id != req.request_id:
                            continue
                        self._add_event(result, o.token_id, o.text, o.logprob, o.top_logprobs, o.finish_reason,
                                        o.metrics)
                        if on_token is not None:
                            on_token(o.token_id, o.text)
        return self._output(result, prompt, list(prompt_ids))

    # ---- streaming, for servers and other threads ---------------------------------------------
    def submit(self, prompt_token_ids, params: SamplingParams, request_id=None):
        """Queue a request on the engine's own thread; returns a RequestStream of TokenEvents.
        Thread-safe. From the first call on, the engine thread owns the engine."""
        with self._lock:
            if self._async is None:
                from scratchllm.engine import AsyncEngine

                self._async = AsyncEngine(self.engine)
        return self._async.submit(prompt_token_ids, params, request_id)

    def abort(self, request_id) -> None:
        if self._async is not None:
            self._async.abort(request_id)

    def stats(self) -> dict:
        return self._async.stats() if self._async is not None else self.engine.stats()

    def shutdown(self, drain: bool = True) -> None:
        if self._async is not None:
            self._async.shutdown(drain)

    # ---- results ------------------------------------------------------------------------------
    @staticmethod
    def _add_event(result, token_id, text, logprob, top, finish_reason, metrics) -> None:
        if token_id is not None:
            result["token_ids"].append(token_id)
            if result["logprobs"] is not None:
                top = list(top.items()) if isinstance(top, dict) else top
                result["logprobs"].append((logprob, top))
        result["text"] += text
        if finish_reason is not None:
            result["finish_reason"], result["metrics"] = finish_reason, metrics

    def _collect(self, stream, params: SamplingParams) -> dict:
        result = {"request_id": stream.request_id, "token_ids": [], "text": "", "finish_reason": None,
                  "metrics": None, "logprobs": [] if params.logprobs is not None else None}
        for e in stream:
            self._add_event(result, e.token_id, e.text, e.logprob, e.top_logprobs, e.finish_reason, e.metrics)
        return result

    @staticmethod
    def _output(result: dict, prompt: str | None, prompt_ids: list[int]) -> RequestOutput:
        m = result["metrics"]
        metrics = dataclasses.asdict(m) if m is not None else {}
        if m is not None:
            prefill_s, decode_s = m.prefill_ms / 1000, m.decode_ms / 1000
            decoded = m.completion_tokens - 1  # the first token comes from the prefill's logits
            metrics.update(prefill_s=prefill_s, decode_s=decode_s, ttft_s=(m.queue_ms + m.prefill_ms) / 1000,
                           prefill_tok_s=m.prompt_tokens / prefill_s if prefill_s > 0 else None,
                           decode_tok_s=decoded / decode_s if decoded > 0 and decode_s > 0 else None)
        return RequestOutput(request_id=result["request_id"], prompt=prompt, prompt_token_ids=prompt_ids,
                             token_ids=result["token_ids"], text=result["text"],
                             finish_reason=result["finish_reason"], metrics=metrics, logprobs=result["logprobs"])
