"""The chat page renders answers as markdown, safely, in a real browser (Debian's chromium through
Playwright) against an engine that writes a given text: a fenced Python block is highlighted and
its copy button copies it; raw HTML, an `onerror` handler, a `<script>` and a `javascript:` link
in an answer run nothing (a canary: the page's title) and show as text, with the page's CSP and
without it (the sanitizer alone); a fence cut by max_tokens renders closed; a finished block
stays the same node while the answer streams on; the layout holds from 360 px to wide screens
(screenshots at 390 and 1280 px, into docs/ with SCRATCHLLM_CHAT_SCREENSHOTS=docs); a model
that fails to load is said once; the vendored files are the pinned ones."""

import hashlib
import os
from pathlib import Path

import httpx
import pytest

from scratchllm.engine.fake import FakeEngine
from scratchllm.server import chat_page
from scratchllm.server.app import ServerConfig, create_app
from scratchllm.server.registry import ModelRegistry, ModelSpec
from scratchllm.server.state import ServedModel

from .conftest import live_server
from .scripted import ScriptedEngine

CHROMIUM = "/usr/bin/chromium"
needs_chromium = pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="chromium not installed")
CANARY = "document.title='pwned'"
PYTHON = "def add(a, b):\n    return a + b\n\nprint(add(2, 3))"
MARKDOWN = ("Here is **the function**, with a list:\n\n- one\n- two\n\n```python\n" + PYTHON + "\n```\n\n"
            "And `inline code` after it.")
HOSTILE = (f'An image: <img src=x onerror="{CANARY}"> and a script: <script>{CANARY}</script>\n\n'
           f"<div onmouseover=\"{CANARY}\">hover me</div>\n\n[click me](javascript:{CANARY}) and "
           f'![pic](x" onerror="{CANARY})')


def scripted_server(reply: str, step_ms: float = 0.2, specs: list[ModelSpec] | None = None):
    engine = ScriptedEngine(step_ms=step_ms, max_running=4)
    engine.reply = reply
    if specs is None:
        registry = ModelRegistry.serving(ServedModel("fake", engine, engine.tokenizer, 4096), None)
    else:
        registry = ModelRegistry(specs)
    return live_server(create_app(registry, config=ServerConfig())), engine


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=[
            "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--disable-component-update", "--disable-sync", "--no-first-run"])
        yield browser
        browser.close()


def ask(page, url, prompt="Hi", max_tokens=None):
    outside = []
    page.on("request", lambda r: None if r.url.startswith(url) else outside.append(r.url))
    page.goto(url + "/")
    page.wait_for_selector("#model option", state="attached")
    if max_tokens is not None:
        page.click("#sampling summary")
        page.fill("#max-tokens", str(max_tokens))
        page.click("#sampling summary")
    page.fill("#prompt", prompt)
    page.press("#prompt", "Enter")
    page.wait_for_selector(".msg.assistant[data-done]")
    assert outside == []
    return page.locator(".msg.assistant").last


def test_the_vendored_files_are_the_pinned_ones_and_served_here():
    for name, asset in chat_page.ASSETS.items():
        data = (chat_page.ASSET_DIR / name).read_bytes()
        assert hashlib.sha256(data).hexdigest() == asset.sha256, name
        assert asset.version in (chat_page.ASSET_DIR / "NOTICE.md").read_text(), name
    assert {p.name for p in (chat_page.ASSET_DIR / "licenses").iterdir()} == {
        "marked.LICENSE.txt", "dompurify.LICENSE.txt", "highlight.js.LICENSE.txt"}
    server, _ = scripted_server("ok")
    with server as url:
        page = httpx.get(url + "/")
        assert 'src="/assets/purify.min.js" integrity="sha384-' in page.text
        assert "script-src 'self' 'sha256-" in page.headers["content-security-policy"]
        js = httpx.get(url + "/assets/marked.umd.js")
        assert js.status_code == 200 and js.headers["content-type"].startswith("text/javascript")
        assert hashlib.sha256(js.content).hexdigest() == chat_page.ASSETS["marked.umd.js"].sha256
        assert httpx.get(url + "/assets/..%2Fapp.py").status_code == 404
        assert httpx.get(url + "/assets/nothing.js").status_code == 404


def test_a_tampered_asset_is_never_served(tmp_path, monkeypatch):
    (tmp_path / "purify.min.js").write_bytes(b"window.DOMPurify = {sanitize: (x) => x};")
    monkeypatch.setattr(chat_page, "ASSET_DIR", tmp_path)
    chat_page.asset_bytes.cache_clear()
    try:
        with pytest.raises(RuntimeError, match="pinned"):
            chat_page.asset_bytes("purify.min.js")
    finally:
        chat_page.asset_bytes.cache_clear()


@needs_chromium
def test_a_python_fence_is_highlighted_and_its_copy_button_copies_it(browser):
    server, _ = scripted_server(MARKDOWN)
    context = browser.new_context(viewport={"width": 1100, "height": 800})
    context.grant_permissions(["clipboard-read", "clipboard-write"])
    page = context.new_page()
    with server as url:
        answer = ask(page, url)
        content = answer.locator(".content")
        assert content.locator("strong").text_content() == "the function"
        assert content.locator("li").count() == 2
        code = content.locator("pre code.language-python")
        assert code.text_content() == PYTHON + "\n"
        assert code.locator("span.hljs-keyword").first.text_content() == "def"
        assert code.locator("span.hljs-built_in").first.text_content() == "print"
        assert content.locator("code").last.text_content() == "inline code"
        family = code.evaluate("c => getComputedStyle(c).fontFamily")
        assert "mono" in family.lower()
        content.locator("pre .copy").click()
        page.wait_for_selector("pre .copy:text('copied')")
        assert page.evaluate("navigator.clipboard.readText()") == PYTHON + "\n"
    context.close()


@needs_chromium
@pytest.mark.parametrize("csp", ["with the page's CSP", "the sanitizer alone"])
def test_hostile_html_runs_nothing_and_shows_as_text(browser, csp):
    server, _ = scripted_server(HOSTILE)
    context = browser.new_context(viewport={"width": 1100, "height": 800}, bypass_csp=csp != "with the page's CSP")
    page = context.new_page()
    with server as url:
        answer = ask(page, url)
        content = answer.locator(".content")
        content.get_by_text("hover me").hover()
        link = content.locator("a", has_text="click me")
        if link.count():
            link.click()
        page.wait_for_timeout(300)
        assert page.title() == "scratchllm chat"  # the canary
        assert not (link.get_attribute("href") or "").lower().startswith("javascript") if link.count() else True
        text = content.text_content()
        assert f'<img src=x onerror="{CANARY}">' in text and f"<script>{CANARY}</script>" in text
        assert "hover me" in text and "click me" in text
        handlers = content.evaluate(
            "c => [...c.querySelectorAll('*')].flatMap(e => [...e.attributes].map(a => a.name))"
            ".filter(n => n.startsWith('on'))")
        assert handlers == []
        assert content.locator("script, iframe, object, embed").count() == 0
    context.close()


@needs_chromium
def test_a_cut_fence_renders_closed(browser):
    server, _ = scripted_server("Start:\n\n```python\nfor i in range(10):\n    print(i)\n# more to come and more")
    page = browser.new_page(viewport={"width": 1100, "height": 800})
    with server as url:
        answer = ask(page, url, max_tokens=40)
        assert answer.get_attribute("data-done") == "note"  # stopped at max tokens
        content = answer.locator(".content")
        assert content.locator("p").first.text_content() == "Start:"
        code = content.locator("pre code.language-python")
        assert code.text_content().startswith("for i in range(10):")
        assert "```" not in content.text_content()
        assert content.evaluate("c => c.lastElementChild.tagName") == "PRE"
    page.close()


@needs_chromium
def test_streaming_keeps_finished_blocks_and_follows_the_answer(browser):
    long = "First paragraph, finished early.\n\n" + "\n\n".join(f"Paragraph {i} " + "word " * 12 for i in range(40))
    server, _ = scripted_server(long, step_ms=3.0)
    page = browser.new_page(viewport={"width": 900, "height": 500})
    with server as url:
        page.goto(url + "/")
        page.wait_for_selector("#model option", state="attached")
        page.fill("#prompt", "Go")
        page.press("#prompt", "Enter")
        page.wait_for_selector(".msg.assistant .content p:nth-of-type(3)")
        first = page.locator(".msg.assistant .content p").first.element_handle()
        page.wait_for_selector(".msg.assistant[data-done]", timeout=60_000)
        assert first.evaluate("p => p.isConnected")  # the same node from the first render to the last
        at_bottom = page.evaluate("(() => { const m = document.getElementById('messages');"
                                  " return m.scrollHeight - m.scrollTop - m.clientHeight; })()")
        assert at_bottom < 60
        meta = page.locator(".msg.assistant .meta")
        assert meta.locator("summary").is_visible() and not meta.locator(".request-id").is_visible()
        meta.locator("summary").click()
        assert meta.locator(".request-id").is_visible()
    page.close()


@needs_chromium
@pytest.mark.parametrize("width", [360, 390, 1100, 1280])
def test_the_layout_holds_from_360_px_to_wide(browser, width, tmp_path):
    server, _ = scripted_server(MARKDOWN + "\n\n| a | b |\n|---|---|\n| " + "x" * 80 + " | y |")
    page = browser.new_page(viewport={"width": width, "height": 760})
    with server as url:
        answer = ask(page, url, prompt="Write a Python function that adds two numbers")
        assert answer.locator(".meta summary").text_content().startswith("first token ")
        overflow = page.evaluate("document.documentElement.scrollWidth - document.documentElement.clientWidth")
        assert overflow <= 0
        header = page.locator("header").bounding_box()
        assert header["height"] < (80 if width < 600 else 48)  # one row from 600 px up
        assert page.input_value("#temperature") == "0"  # the fake model's file says nothing: greedy
        assert "greedy" in page.locator("#sampling summary").text_content()
        if width in (390, 1280):
            folder = Path(os.environ.get("SCRATCHLLM_CHAT_SCREENSHOTS") or tmp_path)
            page.screenshot(path=str(folder / f"chat-page-{width}.png"))
    page.close()


@needs_chromium
def test_the_models_own_sampling_defaults_are_taken_and_shown(browser):
    def load():
        engine = FakeEngine(step_ms=0.2)
        return ServedModel("tuned", engine, engine.tokenizer, 2048)

    spec = ModelSpec("tuned", "generate", load, details={"sampling": {"temperature": 0.6, "top_p": 0.95}})
    server, _ = scripted_server("", specs=[spec])
    page = browser.new_page(viewport={"width": 1100, "height": 700})
    with server as url:
        page.goto(url + "/")
        page.wait_for_selector("#model option", state="attached")
        assert page.input_value("#temperature") == "0.6" and page.input_value("#top-p") == "0.95"
        assert page.locator("#sampling summary").text_content().startswith("T 0.6 · p 0.95")
        page.click("#sampling summary")
        assert page.locator("#sampling-source").text_content() == "defaults from the model file"
    page.close()


@needs_chromium
def test_a_model_that_fails_to_load_is_said_once(browser):
    def load():
        raise RuntimeError("the weights file is truncated")

    server, _ = scripted_server("", specs=[ModelSpec("broken", "generate", load)])
    page = browser.new_page(viewport={"width": 1100, "height": 700})
    with server as url:
        answer = ask(page, url)
        assert answer.get_attribute("data-done") == "error"
        assert page.locator("body").text_content().count("the weights file is truncated") == 1
    page.close()


def test_screenshots_in_docs_are_there():
    docs = Path(__file__).parents[2] / "docs"
    for width in (390, 1280):
        assert (docs / f"chat-page-{width}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

