"""The chat page at `/`: one static HTML file (chat_page.html, inline CSS and JS, nothing fetched
from elsewhere) that talks to this server's own OpenAI API: the models from /v1/models, answers
streamed from /v1/chat/completions (SSE) and stopped by aborting the request (the server then
aborts the generation and frees its KV blocks), each answer's `timings`, the sampling settings,
and the API key when the server has one (asked for on a 401, kept in the tab's sessionStorage).

The page is served to anyone who can reach the server, like /health: it holds no data. What it
is told of the server (a JSON block, below) is the token trace ring's path, so that an answer
can name the command that shows its request in the trace. A Content-Security-Policy lets the
page run only its own script and talk only to this origin.
"""

import base64
import hashlib
import json
import re
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse

PAGE = Path(__file__).with_name("chat_page.html")
CONFIG_MARK = "__CONFIG__"


def _csp(html: str) -> str:
    """The page's policy: its inline script and style by their hashes, requests to itself only."""
    def hashes(tag: str) -> str:
        bodies = re.findall(rf"<{tag}>(.*?)</{tag}>", html, re.S)  # the executable ones: no attributes
        return " ".join(f"'sha256-{base64.b64encode(hashlib.sha256(b.encode()).digest()).decode()}'"
                        for b in bodies)

    return (f"default-src 'none'; script-src {hashes('script')}; style-src {hashes('style')}; "
            "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


def render(config: dict[str, Any]) -> str:
    """The page with `config` in its JSON block (escaped so that no value can end the block)."""
    text = PAGE.read_text(encoding="utf-8")
    assert text.count(CONFIG_MARK) == 1, "the page has one config block"
    return text.replace(CONFIG_MARK, json.dumps(config).replace("<", "\\u003c").replace(">", "\\u003e"))


def install(app: FastAPI) -> None:
    """GET / serves the page (left out of /openapi.json: it is no API)."""

    @app.get("/", include_in_schema=False, response_model=None)
    async def chat_page(request: Request) -> HTMLResponse:
        trace = getattr(request.app.state.server, "trace", None)  # None: a server of embedding models only
        html = render({"trace_ring": str(trace.path) if trace is not None else None})
        return HTMLResponse(html, headers={"Content-Security-Policy": _csp(html), "Cache-Control": "no-cache",
                                           "X-Content-Type-Options": "nosniff"})
