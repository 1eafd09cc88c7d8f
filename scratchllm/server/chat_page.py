"""The chat page at `/`: one HTML file (chat_page.html, its own CSS and JS inline) that talks to
this server's own OpenAI API: the models from /v1/models (each with its sampling defaults),
answers streamed from /v1/chat/completions (SSE) and stopped by aborting the request (the server
then aborts the generation and frees its KV blocks), each answer's `timings`, the sampling
settings, and the API key when the server has one (asked for on a 401, kept in the tab's
sessionStorage).

Answers are markdown. The three libraries that render them are vendored in assets/, pinned
(ASSETS: each file's SHA-256, checked before it is served; the page loads each with its
Subresource Integrity hash) and served by this server at /assets/NAME: nothing is fetched from
anywhere else. assets/NOTICE.md names each one's package, version and licence.

The page is served to anyone who can reach the server, like /health: it holds no data. What it
is told of the server (a JSON block) is the token trace ring's path, so that an answer can name
the command that shows its request in the trace. A Content-Security-Policy lets the page run
only its own inline script (by its hash) and the vendored files, and talk only to this origin.
"""

import base64
import hashlib
import json
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, Response

from scratchllm.server.errors import APIError

PAGE = Path(__file__).with_name("chat_page.html")
ASSET_DIR = Path(__file__).with_name("assets")
CONFIG_MARK = "__CONFIG__"


@dataclass(frozen=True)
class Asset:
    """A vendored file: the npm package and version it comes from, its licence, its SHA-256."""

    package: str
    version: str
    licence: str
    sha256: str


ASSETS = {
    "marked.umd.js": Asset("marked", "18.3.0", "MIT",
                           "f8c7f128939415995e2219e8a84bec42fab27f5980d22e361339e6901da5eadf"),
    "purify.min.js": Asset("dompurify", "3.5.0", "MPL-2.0 OR Apache-2.0",
                           "f69a46022ab1f53e969c8ebbca98172c8995785a9b3be72ea4a12d25b1a1bf67"),
    "highlight.min.js": Asset("@highlightjs/cdn-assets", "11.12.0", "BSD-3-Clause",
                              "8ab71eb09c51f501e5e25157d9cff100e46cc29bcbfc744d0b746d451fca7f53"),
    "highlight-github.min.css": Asset("@highlightjs/cdn-assets styles/github.min.css", "11.12.0", "BSD-3-Clause",
                                      "3a9a5def8b9c311e5ae43abde85c63133185eed4f0d9f67fea4b00a8308cf066"),
}


@lru_cache(maxsize=len(ASSETS))
def asset_bytes(name: str) -> bytes:
    """A vendored file's bytes, checked against its pinned SHA-256 (a file changed on disk is an
    error, never served)."""
    data = (ASSET_DIR / name).read_bytes()
    got = hashlib.sha256(data).hexdigest()
    if got != ASSETS[name].sha256:
        raise RuntimeError(f"{ASSET_DIR / name}: SHA-256 {got}, pinned {ASSETS[name].sha256}; reinstall scratchllm")
    return data


def _b64_sha(algorithm: str, data: bytes) -> str:
    return f"{algorithm}-{base64.b64encode(hashlib.new(algorithm, data).digest()).decode()}"


def _csp(html: str) -> str:
    """The page's policy: its inline script and style by their hashes and the vendored files,
    requests to itself only."""
    def hashes(tag: str) -> str:
        bodies = re.findall(rf"<{tag}>(.*?)</{tag}>", html, re.S)  # the executable ones: no attributes
        return " ".join(f"'{_b64_sha('sha256', b.encode())}'" for b in bodies)

    return (f"default-src 'none'; script-src 'self' {hashes('script')}; style-src 'self' {hashes('style')}; "
            "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


def render(config: dict[str, Any]) -> str:
    """The page with `config` in its JSON block (escaped so that no value can end the block) and
    each vendored file's integrity hash."""
    text = PAGE.read_text(encoding="utf-8")
    assert text.count(CONFIG_MARK) == 1, "the page has one config block"
    for name in ASSETS:
        text = text.replace(f"__SRI_{name}__", _b64_sha("sha384", asset_bytes(name)))
    return text.replace(CONFIG_MARK, json.dumps(config).replace("<", "\\u003c").replace(">", "\\u003e"))


def install(app: FastAPI) -> None:
    """GET / serves the page and GET /assets/NAME its vendored files (left out of /openapi.json:
    they are no API)."""

    @app.get("/", include_in_schema=False, response_model=None)
    async def chat_page(request: Request) -> HTMLResponse:
        trace = getattr(request.app.state.server, "trace", None)  # None: a server of embedding models only
        html = render({"trace_ring": str(trace.path) if trace is not None else None})
        return HTMLResponse(html, headers={"Content-Security-Policy": _csp(html), "Cache-Control": "no-cache",
                                           "X-Content-Type-Options": "nosniff"})

    @app.get("/assets/{name}", include_in_schema=False, response_model=None)
    async def asset(name: str) -> Response:
        if name not in ASSETS:
            raise APIError(404, f"no asset '{name}'", type="not_found")
        media_type = "text/css; charset=utf-8" if name.endswith(".css") else "text/javascript; charset=utf-8"
        return Response(asset_bytes(name), media_type=media_type,
                        headers={"Cache-Control": "public, max-age=86400", "X-Content-Type-Options": "nosniff"})
