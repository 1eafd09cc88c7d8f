"""The chat page at `/` (server/chat_page.py), driven in a real browser (Debian's chromium through
Playwright) against the fake engine behind an API key: the key asked for, a message typed and
sent, the answer streamed in with its timings and its request id (the one the server's spans of
that reply carry in the token trace ring), a second answer stopped midway (the engine aborts it
and frees its KV blocks); and the page itself: no API, no outside request, a config block no
value can break out of."""

import json
import os
import shutil
import time

import httpx
import pytest

from scratchllm.server import chat_page
from scratchllm.server.app import ServerConfig, create_app
from scratchllm.server.backend import fake_backend
from scratchllm.trace.format import request_key
from scratchllm.trace.views.analysis import Trace
from scratchllm.trace.writer import TraceWriter

from .conftest import live_server

CHROMIUM = "/usr/bin/chromium"
KEY = "chat-page-key"


def test_the_page_is_served_open_and_is_no_api():
    model, _ = fake_backend(step_ms=1.0)
    app = create_app(model, None, ServerConfig(api_key=KEY))
    with live_server(app) as url:
        page = httpx.get(url + "/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        csp = page.headers["content-security-policy"]
        assert "default-src 'none'" in csp and "connect-src 'self'" in csp and "'unsafe-inline'" not in csp
        assert '<script id="config" type="application/json">{"trace_ring": null}</script>' in page.text
        assert "http://" not in page.text and "https://" not in page.text  # nothing fetched from elsewhere
        assert httpx.get(url + "/v1/models").status_code == 401  # the API still needs the key
        assert "/" not in httpx.get(url + "/openapi.json").json()["paths"]
    hostile = chat_page.render({"trace_ring": "/tmp/</script><script>alert(1)</script>.ring"})
    block = hostile.split('<script id="config" type="application/json">')[1].split("</script>")[0]
    assert json.loads(block) == {"trace_ring": "/tmp/</script><script>alert(1)</script>.ring"}


@pytest.mark.skipif(not os.path.exists(CHROMIUM) and shutil.which("chromium") is None, reason="chromium not installed")
def test_type_send_stream_and_stop_in_a_real_browser(tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api")
    model, _ = fake_backend(step_ms=25.0)
    engine = model.engine
    ring = TraceWriter(tmp_path / "trace.ring", ring_bytes=1 << 20)
    app = create_app(model, None, ServerConfig(api_key=KEY), trace=ring)
    with live_server(app) as url, sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=[
            "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--disable-component-update", "--disable-sync", "--no-first-run"])
        try:
            page = browser.new_page(viewport={"width": 1100, "height": 700})
            outside = []
            page.on("request", lambda r: None if r.url.startswith(url) else outside.append(r.url))
            sent = []
            page.on("request", lambda r: sent.append(json.loads(r.post_data)) if r.method == "POST" else None)
            page.goto(url + "/")
            page.wait_for_selector("#key-panel:not(.hidden)")  # /v1/models said 401
            page.fill("#api-key", KEY)
            page.click("#save-key")
            page.wait_for_selector("#model option", state="attached")  # (no wait_for_function: the CSP forbids eval)
            assert page.input_value("#model") == "fake"
            assert page.input_value("#temperature") == "0"  # the fake's file recommends nothing: greedy
            page.click("#sampling summary")
            page.fill("#max-tokens", "24")
            page.click("#sampling summary")
            page.fill("#prompt", "Hello there")
            page.press("#prompt", "Enter")
            page.wait_for_selector(".msg.assistant[data-done]")
            first = page.locator(".msg.assistant").nth(0)
            assert first.get_attribute("data-done") == "note"  # it stopped at max tokens, as asked
            answer = first.get_attribute("data-raw")
            reference = httpx.post(url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                                   json={"model": "fake", "messages": [{"role": "user", "content": "Hello there"}],
                                         "temperature": 0, "max_tokens": 24}).json()
            assert answer == reference["choices"][0]["message"]["content"] and len(answer) > 10
            timings = first.locator(".meta").text_content()
            for part in ("queue ", "prefill ", "decode ", "tok/s", "first token ", "24 tokens",
                         "stopped at max tokens"):
                assert part in timings, (part, timings)
            request_id = first.locator(".request-id").text_content()
            assert request_id.startswith("chatcmpl-") and request_id != reference["id"]
            command = first.locator(".trace-command").text_content()
            assert command == f"scratchllm trace export {tmp_path / 'trace.ring'} -o trace.json"
            # the id the page shows is the one the server's spans of that reply carry in the ring
            assert request_key(request_id) in Trace.load(tmp_path / "trace.ring").spans["request"].tolist()
            assert sent[0] == {"model": "fake", "messages": [{"role": "user", "content": "Hello there"}],
                               "stream": True, "temperature": 0, "top_p": 1, "max_tokens": 24}

            # a long answer, stopped while it streams: the engine aborts it and frees its blocks
            page.click("#sampling summary")
            page.fill("#max-tokens", "1500")
            page.click("#sampling summary")
            page.fill("#prompt", "Tell me more")
            page.click("#send")
            second = page.locator(".msg.assistant").nth(1)
            deadline = time.monotonic() + 10
            while len(second.locator(".content").text_content()) <= 20:  # streaming, well short of the end
                assert time.monotonic() < deadline
                time.sleep(0.02)
            assert page.is_enabled("#stop") and not page.is_enabled("#send")
            shot = os.environ.get("SCRATCHLLM_CHAT_SCREENSHOT", str(tmp_path / "chat.png"))
            page.screenshot(path=shot)
            page.click("#stop")
            page.wait_for_selector(".msg.assistant:nth-of-type(4)[data-done]")
            assert second.get_attribute("data-done") == "stopped"
            assert "stopped" in second.locator(".meta").text_content()
            assert len(second.locator(".content").text_content()) < 1000  # far from its 1500 tokens
            assert sent[1]["messages"][1] == {"role": "assistant", "content": answer}  # the history went along
            deadline = time.monotonic() + 5
            while engine.stats().running or engine.stats().kv_blocks_used:
                assert time.monotonic() < deadline, engine.stats()
                time.sleep(0.02)
            assert outside == []
            with open(shot, "rb") as f:
                assert f.read(8) == b"\x89PNG\r\n\x1a\n"
        finally:
            browser.close()
            ring.close()
