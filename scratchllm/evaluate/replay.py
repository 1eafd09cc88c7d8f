"""Replay: every captured request sent to the primary, secondary and candidate servers.

Any OpenAI-compatible server works (/v1/completions and /v1/chat/completions, non-streamed).
Each request goes to the three servers at once; each server sees at most `concurrency`
requests in flight (one limit per URL, so a secondary that is a second pass on the primary
shares the primary's). Connection errors, 429 and 5xx are retried with exponential backoff
(honouring Retry-After); any other status is recorded as that output's error.

What is asked of the servers, so the outputs can be diffed token by token:
  * sampling: greedy (temperature 0) unless the captured request carried a seed, whose
    temperature and seed are then kept (`sampling="greedy"` forces greedy everywhere);
  * the top-k logprobs of every generated token (completions `logprobs: k`; chat
    `logprobs: true, top_logprobs: k`): the tokens are read from them, since the OpenAI format
    has no token ids (a server's `token_ids` field is kept where it sends one);
  * never a stream.
"""

import asyncio
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from scratchllm.errors import ConfigError
from scratchllm.evaluate.feedback import request_class
from scratchllm.evaluate.sources import CapturedRequest, Traffic
from scratchllm.evaluate.store import ROLES, Output, RunStore

logger = logging.getLogger(__name__)

RETRY_STATUS = {408, 429, 500, 502, 503, 504}


@dataclass
class ReplayOptions:
    primary: str
    candidate: str
    secondary: str | None = None  # None: a second pass on the primary
    api_key: str | None = None
    concurrency: int = 4  # requests in flight per server
    retries: int = 3
    backoff_s: float = 0.5  # the first retry's wait; doubled each time
    timeout_s: float = 300.0
    top_logprobs: int = 5
    sampling: str = "auto"  # "auto": greedy unless a seed was captured; "greedy": always greedy
    model: str | None = None  # overrides the captured model name on every server
    max_tokens: int | None = None  # caps each request's output length
    progress: bool = True

    def __post_init__(self) -> None:
        if self.concurrency < 1 or self.retries < 0 or self.top_logprobs < 1:
            raise ConfigError("concurrency and top_logprobs must be >= 1, retries >= 0")
        if self.sampling not in ("auto", "greedy"):
            raise ConfigError(f"sampling must be 'auto' or 'greedy', got {self.sampling!r}")
        for name in ("primary", "candidate", "secondary"):
            url = getattr(self, name)
            if url is not None and not url.startswith(("http://", "https://")):
                raise ConfigError(f"--{name} must be an http(s) URL, got {url!r}")

    def urls(self) -> dict[str, str]:
        return {"primary": self.primary, "secondary": self.secondary or self.primary, "candidate": self.candidate}


def replay_body(req: CapturedRequest, opts: ReplayOptions) -> dict[str, Any]:
    """The body sent to all three servers: the captured one, made greedy (or seeded), with
    top-k logprobs and without streaming."""
    body = {k: v for k, v in req.body.items() if k not in ("stream", "stream_options", "n")}
    if opts.model:
        body["model"] = opts.model
    if opts.sampling == "greedy" or body.get("seed") is None:
        body["temperature"] = 0.0
        body.pop("seed", None)
    if opts.max_tokens is not None:
        key = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
        body[key] = min(int(body.get(key) or opts.max_tokens), opts.max_tokens)
    if req.endpoint == "/v1/chat/completions":
        body["logprobs"], body["top_logprobs"] = True, opts.top_logprobs
    else:
        body["logprobs"] = opts.top_logprobs
    return body


def parse_response(endpoint: str, data: dict[str, Any]) -> Output:
    """An OpenAI response body -> Output (text, token strings, logprobs, top-k)."""
    choice = data["choices"][0]
    out = Output(finish_reason=choice.get("finish_reason"), timings=data.get("timings"))
    out.token_ids = choice.get("token_ids")
    lp = choice.get("logprobs") or {}
    if endpoint == "/v1/chat/completions":
        out.text = (choice.get("message") or {}).get("content") or ""
        for item in lp.get("content") or []:
            out.tokens.append(item["token"])
            out.logprobs.append(item.get("logprob"))
            out.top_logprobs.append([(t["token"], t["logprob"]) for t in item.get("top_logprobs") or []])
    else:
        out.text = choice.get("text") or ""
        out.tokens = list(lp.get("tokens") or [])
        out.logprobs = list(lp.get("token_logprobs") or [])
        out.top_logprobs = [sorted((top or {}).items(), key=lambda p: -p[1]) for top in lp.get("top_logprobs") or []]
    return out


class Replayer:
    def __init__(self, opts: ReplayOptions, transport: httpx.AsyncBaseTransport | None = None):
        self.opts = opts
        headers = {"Authorization": f"Bearer {opts.api_key}"} if opts.api_key else {}
        self.client = httpx.AsyncClient(headers=headers, timeout=opts.timeout_s, transport=transport)
        self.limits = {url: asyncio.Semaphore(opts.concurrency) for url in set(opts.urls().values())}

    async def send(self, url: str, endpoint: str, body: dict[str, Any]) -> Output:
        error, status = None, None
        for attempt in range(1, self.opts.retries + 2):
            async with self.limits[url]:
                start = time.perf_counter()
                try:
                    response = await self.client.post(url.rstrip("/") + endpoint, json=body)
                except httpx.HTTPError as err:
                    status, error, wait = None, f"{type(err).__name__}: {err}", None
                else:
                    latency_ms = (time.perf_counter() - start) * 1e3
                    status = response.status_code
                    if status == 200:
                        try:
                            out = parse_response(endpoint, response.json())
                        except (ValueError, KeyError, IndexError, TypeError) as err:
                            return Output(status=status, error=f"unreadable response: {err}", attempts=attempt)
                        out.status, out.latency_ms, out.attempts = status, latency_ms, attempt
                        return out
                    error = f"HTTP {status}: {response.text[:500]}"
                    if status not in RETRY_STATUS:
                        return Output(status=status, error=error, attempts=attempt)
                    wait = _retry_after(response)
            if attempt <= self.opts.retries:
                await asyncio.sleep(wait if wait is not None else self.opts.backoff_s * 2 ** (attempt - 1))
        logger.warning("%s%s: giving up after %d attempts: %s", url, endpoint, self.opts.retries + 1, error)
        return Output(status=status, error=error, attempts=self.opts.retries + 1)

    async def one(self, store: RunStore, request_id: int, endpoint: str, body: dict[str, Any]) -> None:
        urls = self.opts.urls()
        outs = await asyncio.gather(*(self.send(urls[role], endpoint, body) for role in ROLES))
        for role, out in zip(ROLES, outs, strict=True):
            store.put_output(request_id, role, out)

    async def run(self, store: RunStore, items: list[tuple[int, str, dict[str, Any]]]) -> None:
        from tqdm import tqdm

        bar = tqdm(total=len(items), desc="replay", unit="req", disable=not self.opts.progress)
        try:
            async def tracked(item: tuple[int, str, dict[str, Any]]) -> None:
                await self.one(store, *item)
                bar.update(1)

            await asyncio.gather(*(tracked(item) for item in items))
        finally:
            bar.close()
            await self.client.aclose()


def _retry_after(response: httpx.Response) -> float | None:
    try:
        return min(float(response.headers["retry-after"]), 60.0)
    except (KeyError, ValueError):
        return None


def replay(traffic: Traffic, out_path: str | Path, opts: ReplayOptions, capture: str = "",
           transport: httpx.AsyncBaseTransport | None = None) -> RunStore:
    """Replays `traffic` into a new run file at `out_path` (its outputs; triage is separate)."""
    if not traffic.requests:
        raise ConfigError("the capture holds no requests to replay")
    store = RunStore(out_path, create=True)
    options = {k: v for k, v in vars(opts).items() if k not in ("api_key", "progress")}
    options["partial_lines"] = traffic.partial_lines
    urls = opts.urls()
    store.create_run(capture, urls["primary"], urls["secondary"], urls["candidate"], options)
    items: list[tuple[int, str, dict[str, Any]]] = []
    for idx, req in enumerate(traffic.requests):
        body = replay_body(req, opts)
        rid = store.add_request(idx, req.endpoint, req.source, req.body, body, request_class(req.body))
        items.append((rid, req.endpoint, body))
    asyncio.run(Replayer(opts, transport).run(store, items))
    return store
