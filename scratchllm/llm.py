"""`LLM`: the one-line way to run a model. `LLM("default").generate(["Hi"], SamplingParams(...))`.

LLM resolves the model and its tokenizer, applies chat templates and shapes the results; the
work itself runs on the engine (scratchllm.engine): many prompts are batched continuously over
the paged KV cache, and greedy outputs equal each prompt run alone (tests/engine).

Two ways to drive the engine, never both at once:
  - `generate` / `chat` / `run` step the engine in the caller's thread until their requests finish;
  - `submit` starts the engine's own thread (AsyncEngine) for streaming from any thread; from then
    on every call goes through that thread, since only one thread may touch the engine.

Why a request finishes ("stop" or "length") is decided in the engine's one output path
(scratchllm/engine/output.py). Results are RequestOutput (scratchllm/engine/protocol.py):
`.token_ids`, `.text`, `.finish_reason`, `.metrics` (RequestMetrics: times, durations,
`.summary()` with rates), `.logprobs` when asked for.
"""

import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from scratchllm.engine import EngineConfig, LLMEngine
from scratchllm.engine.output import OutputCollector
from scratchllm.engine.protocol import EngineStats, RequestOutput, RequestStream
from scratchllm.errors import ConfigError
from scratchllm.formats import load_checkpoint
from scratchllm.formats.refs import resolve_model
from scratchllm.models import load_model
from scratchllm.models.bert import BertModel
from scratchllm.models.progress import console_sink, reporting
from scratchllm.sampling import SamplingParams
from scratchllm.tokenizer import Tokenizer

if TYPE_CHECKING:
    from scratchllm.engine.async_engine import AsyncEngine
    from scratchllm.trace.writer import TraceWriter

_ENGINE_OPTIONS = {f.name for f in dataclasses.fields(EngineConfig)}
__all__ = ["LLM", "RequestOutput"]


class LLM:
    """A model, its tokenizer and an engine, ready to generate.

    `model`: "default" (SmolLM2-135M-Instruct), a .gguf file or a Hugging Face model folder.
    `tokenizer`: where the tokenizer lives when it is not beside the weights.
    `max_model_len`: the longest prompt + completion (default: the model's context).
    `threads`: matmul (and BLAS) threads for this process (default: leave as is). 1 is often
    faster on a machine whose cores other jobs share; see scratchllm/models/threads.py.
    `dtype`: "auto" (default: for a Llama GGUF file with quantized blocks, where the CPU has VNNI
    dot products, "int8" for models of 0.4B parameters or more and "int16" below; "quantized" on
    other CPUs; else "float32"), "float32" (the
    reference's numbers), "bfloat16" (faster matmuls, logits that differ in the third digit),
    "quantized" (a GGUF file's quantized blocks kept as they are, exact float32 products: the
    dequantized float32 model's logits bit for bit), "int16"
    (the same blocks times activations rounded to 16 bits, integer dot products: faster, logits
    within about 1e-3 of float32's) or "int8" (activations rounded to 8 bits per 32 values, as
    llama.cpp does: the fastest); see scratchllm/models/packed.py.
    `trace`: a path: the engine writes every token into a trace ring there (docs/tracing.md;
    read it with `scratchllm trace watch|heatmap|export PATH`).
    A step of the load that runs over a second (packing a large model's matrices on its first
    load, writing its panel cache) shows its progress on stderr: a bar on a terminal, a line at
    each tenth of the way elsewhere (models/progress.py).
    Every other option is an EngineConfig field (num_kv_blocks, max_num_seqs, ...).
    """

    OPTIONS = ("tokenizer", "max_model_len", "threads", "dtype", "trace",
               *sorted(_ENGINE_OPTIONS - {"max_model_len"}))

    def __init__(self, model: str | Path = "default", **options: Any) -> None:
        unknown = sorted(set(options) - set(self.OPTIONS))
        if unknown:
            raise ConfigError(f"unknown LLM option(s) {', '.join(unknown)}; known: {', '.join(self.OPTIONS)}")
        threads = options.get("threads")
        if threads is not None:
            from scratchllm.models.threads import set_blas_threads

            if int(threads) < 1:
                raise ConfigError(f"threads must be >= 1, got {threads}")
            set_blas_threads(int(threads))
        start = time.perf_counter()
        # One parse of the file's header for the model and its tokenizer (a GGUF carries both).
        checkpoint = load_checkpoint(resolve_model(model))
        with reporting(console_sink(str(model))):  # a step of the load over a second: a bar, or lines
            loaded = load_model(model, dtype=options.get("dtype") or "auto", checkpoint=checkpoint)
        if not loaded.config.is_decoder:
            kind = loaded.config.model_type
            raise ConfigError(f"'{model}' is an encoder ({kind}): it embeds, it does not generate")
        assert not isinstance(loaded, BertModel), "BERT is the one encoder family"
        self.model = loaded
        self.tokenizer = Tokenizer.from_pretrained(options.get("tokenizer") or model, checkpoint=checkpoint)
        eos = self.tokenizer.eos_token_id
        self.eos_token_id = eos if eos is not None else self.model.config.eos_token_id
        engine_options = {k: v for k, v in options.items() if k in _ENGINE_OPTIONS}
        if threads is not None:
            engine_options.setdefault("num_threads", int(threads))
        self.trace: TraceWriter | None = None
        if options.get("trace"):
            from scratchllm.trace import writer

            self.trace = writer.TraceWriter(options["trace"])
        engine_trace = self.trace.for_model(str(model)) if self.trace is not None else None
        self.engine = LLMEngine(self.model, EngineConfig(**engine_options), tokenizer=self.tokenizer,
                                trace=engine_trace, eos_token_id=self.eos_token_id)
        self.max_model_len = self.engine.max_model_len
        self.load_s = time.perf_counter() - start
        self._async: AsyncEngine | None = None
        self._lock = threading.Lock()  # one caller at a time steps the engine

    # ---- prompts ------------------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict[str, Any]]) -> str:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)

    def chat(self, messages: list[dict[str, Any]], params: SamplingParams | None = None,
             on_token: Callable[[int, str], None] | None = None) -> RequestOutput:
        """One conversation turn: the chat template renders the messages, the model answers."""
        prompt = self.apply_chat_template(messages)
        # the template writes its own special tokens (BOS included) as text
        ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        return self.run(ids, params or SamplingParams(), prompt=prompt, on_token=on_token)

    def generate(self, prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """prompts: a string, a list of strings, or token ids (one list[int] or a list of them).
        params: one SamplingParams for all, or one per prompt. All prompts run batched."""
        params = params or SamplingParams()
        one = isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int))
        batch = cast("Sequence[str | Sequence[int]]", [prompts] if one else prompts)
        texts = [p if isinstance(p, str) else None for p in batch]
        ids = [self.tokenizer.encode(p) if isinstance(p, str) else [int(t) for t in p] for p in batch]
        per_prompt = [params] * len(ids) if isinstance(params, SamplingParams) else list(params)
        if len(per_prompt) != len(ids):
            raise ConfigError(f"{len(ids)} prompts but {len(per_prompt)} SamplingParams")
        for i, p in zip(ids, per_prompt, strict=True):
            self.engine.validate(i, p)  # refuse a bad prompt before any work starts
        if self._async is not None:
            streams = [self._async.submit(i, p) for i, p in zip(ids, per_prompt, strict=True)]
            results = [self._collect(s, i, p) for s, i, p in zip(streams, ids, per_prompt, strict=True)]
        else:
            with self._lock:
                results = self.engine.generate(ids, per_prompt)
        for r, t in zip(results, texts, strict=True):
            r.prompt = t
        return results

    def run(self, prompt_ids: list[int], params: SamplingParams, prompt: str | None = None,
            on_token: Callable[[int, str], None] | None = None) -> RequestOutput:
        """One request to completion. `on_token(id, text_delta)` streams: the delta holds back
        text that could still turn out to be the start of a stop string."""
        self.engine.validate(prompt_ids, params)
        if self._async is not None:
            return self._collect(self._async.submit(prompt_ids, params), prompt_ids, params, prompt, on_token)
        with self._lock:
            req = self.engine.add_request(None, prompt_ids, params)
            collector = OutputCollector(req.request_id, req.prompt_token_ids, prompt, params.logprobs is not None)
            while not collector.finished:
                for event in self.engine.step():
                    if event.request_id == req.request_id:
                        collector.add(event)
                        if on_token is not None and event.token_id is not None:
                            on_token(event.token_id, event.text)
        return collector.output

    # ---- streaming, for servers and other threads ---------------------------------------------
    def submit(self, prompt_token_ids: Sequence[int], params: SamplingParams,
               request_id: str | None = None) -> RequestStream:
        """Queue a request on the engine's own thread; returns a RequestStream of TokenEvents.
        Thread-safe. From the first call on, the engine thread owns the engine."""
        with self._lock:
            if self._async is None:
                from scratchllm.engine import AsyncEngine

                self._async = AsyncEngine(self.engine)
        return self._async.submit(prompt_token_ids, params, request_id)

    def abort(self, request_id: str) -> None:
        if self._async is not None:
            self._async.abort(request_id)

    def stats(self) -> EngineStats:
        return self._async.stats() if self._async is not None else self.engine.stats()

    def shutdown(self, drain: bool = True) -> None:
        if self._async is not None:
            self._async.shutdown(drain)
        if self.trace is not None:
            self.trace.close()

    # ---- results ------------------------------------------------------------------------------
    @staticmethod
    def _collect(stream: RequestStream, prompt_ids: Sequence[int], params: SamplingParams, prompt: str | None = None,
                 on_token: Callable[[int, str], None] | None = None) -> RequestOutput:
        collector = OutputCollector(stream.request_id, list(prompt_ids), prompt, params.logprobs is not None)
        for event in stream:
            collector.add(event)
            if on_token is not None and event.token_id is not None:
                on_token(event.token_id, event.text)
        return collector.output
