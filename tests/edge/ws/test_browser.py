"""The chat page in headless Chromium: type a message, watch streamed text, TTFT and tokens/s; in
dev mode the page connects by itself; answers render as markdown, and model output can inject no
markup (escaped first, then formatted)."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator

import pytest

from devtools.fake_worker import expected_text
from tests.edge.conftest import KEY, running_edge

CHROMIUM = "/usr/bin/chromium"


@pytest.mark.browser
async def test_chat_page_streams(encoder, tmp_path):
    if not os.path.exists(CHROMIUM):
        pytest.fail(f"{CHROMIUM} is missing: `make test` installs it (apt-get install -y chromium)")
    from playwright.async_api import async_playwright

    async with running_edge(encoder, worker_kw={"step_s": 0.01}) as (edge, fw):
        async with async_playwright() as pw:
            browser = await pw.chromium.launch(
                executable_path=CHROMIUM, headless=True,
                args=["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"])
            try:
                page = await browser.new_page()
                await page.goto(f"http://127.0.0.1:{edge.port}/")
                assert await page.inner_text("#status") == "disconnected"  # with a key file: waits for the key
                await page.fill("#apikey", KEY)
                await page.fill("#maxtok", "40")
                await page.fill("#input", "Hello from the browser")
                await page.press("#input", "Enter")
                await page.wait_for_function("document.querySelector('.stats') && "
                                             "document.querySelector('.stats').textContent.includes('length')",
                                             timeout=20_000)
                text = await page.inner_text(".msg.assistant")
                stats = await page.inner_text(".stats")
                shot = tmp_path / "chat.png"
                await page.screenshot(path=str(shot))
            finally:
                await browser.close()
        assert shot.stat().st_size > 1000
        assert text.strip() == expected_text(fw.seen[0].prompt_token_ids, 40).strip()
        assert "TTFT" in stats and "tokens/s" in stats and "40 tokens" in stats
        assert fw.seen[0].tenant == "acme"  # the key travelled as the bearer.<key> subprotocol
        await asyncio.sleep(0)  # one loop tick before the edge stops; no assertion depends on it


@pytest.mark.browser
async def test_chat_page_reconnects_and_resumes_without_a_gap(encoder):
    """The page's connection drops mid-answer (its TCP connection aborted at the edge): it reconnects
    by itself, resumes the request from the next output index, and shows the whole answer once."""
    if not os.path.exists(CHROMIUM):
        pytest.fail(f"{CHROMIUM} is missing: `make test` installs it (apt-get install -y chromium)")
    from playwright.async_api import async_playwright

    async with running_edge(encoder, worker_kw={"step_s": 0.05}) as (edge, fw):
        async with async_playwright() as pw:
            browser = await pw.chromium.launch(
                executable_path=CHROMIUM, headless=True,
                args=["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"])
            try:
                page = await browser.new_page()
                await page.goto(f"http://127.0.0.1:{edge.port}/")
                await page.fill("#apikey", KEY)
                await page.fill("#maxtok", "40")
                await page.fill("#input", "Hello from the browser")
                await page.press("#input", "Enter")
                await page.wait_for_function("document.querySelector('.msg.assistant') && "
                                             "document.querySelector('.msg.assistant').textContent.length > 3",
                                             timeout=20_000)
                assert fw.tokens_sent < 40, "the answer ended before the connection could be dropped"
                for sess in list(edge.sessions):
                    sess.ws.transport.abort()  # the TCP connection drops; the edge stays
                await page.wait_for_function("document.querySelector('.stats') && "
                                             "document.querySelector('.stats').textContent.includes('length')",
                                             timeout=20_000)
                text = await page.inner_text(".msg.assistant")
            finally:
                await browser.close()
        assert text.strip() == expected_text(fw.seen[0].prompt_token_ids, 40).strip()
        assert not fw.cancels  # the request ran on while its client was away


@contextlib.asynccontextmanager
async def chromium_page() -> AsyncIterator:
    if not os.path.exists(CHROMIUM):
        pytest.fail(f"{CHROMIUM} is missing: `make test` installs it (apt-get install -y chromium)")
    from playwright.async_api import async_playwright

    async with async_playwright() as pw:
        browser = await pw.chromium.launch(
            executable_path=CHROMIUM, headless=True,
            args=["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"])
        try:
            page = await browser.new_page()
            page.on("dialog", lambda d: pytest.fail(f"a dialog opened: {d.message}"))  # alert() = injected script
            yield page
        finally:
            await browser.close()


# What the fake worker streams, one piece per token: markdown, and markup that must stay text.
ANSWER = ["## Plan\n", "Some **bold**, *em* and `<b>code</b>` ", "<img src=x onerror=\"window.pwned=1\">", "\n\n",
          "- one\n", "- two\n\n", "```py\n", "x = \"<script>window.pwned=2</script>\"\n", "```\n",
          "[ok](http://127.0.0.1/a?b=1&c=2) [bad](javascript:window.pwned=3)\n\n",
          "| a | b |\n", "|---|---|\n", "| 1 | 2 |\n", "> quoted"]


@pytest.mark.browser
async def test_dev_mode_page_connects_by_itself_and_renders_markdown_safely(encoder):
    worker_kw = {"step_s": 0.01, "token_text": lambda _ids, i: ANSWER[i]}
    async with running_edge(encoder, keys=None, worker_kw=worker_kw) as (edge, fw), chromium_page() as page:
        await page.goto(f"http://127.0.0.1:{edge.port}/")
        # no key typed, no button pressed: the page connected on its own
        await page.wait_for_function("document.querySelector('#status').textContent.startsWith('connected')",
                                     timeout=20_000)
        await page.fill("#maxtok", str(len(ANSWER)))
        await page.fill("#input", "Show me markdown")
        await page.press("#input", "Enter")
        await page.wait_for_function("document.querySelector('.stats') && "
                                     "document.querySelector('.stats').textContent.includes('length')", timeout=20_000)
        answer = page.locator(".msg.assistant")
        assert await answer.locator("h2").inner_text() == "Plan"
        assert await answer.locator("strong").inner_text() == "bold"
        assert await answer.locator("em").inner_text() == "em"
        assert await answer.locator("p code").inner_text() == "<b>code</b>"  # shown, not parsed
        assert await answer.locator("li").all_inner_texts() == ["one", "two"]
        assert await answer.locator("pre code").inner_text() == 'x = "<script>window.pwned=2</script>"'
        assert await answer.locator("a").count() == 1
        assert await answer.locator("a").get_attribute("href") == "http://127.0.0.1/a?b=1&c=2"
        assert "[bad](javascript:window.pwned=3)" in await answer.inner_text()
        assert await answer.locator("td").all_inner_texts() == ["1", "2"]
        assert await answer.locator("blockquote").inner_text() == "quoted"
        assert '<img src=x onerror="window.pwned=1">' in await answer.inner_text()  # as text
        assert await answer.locator("img, script, [onerror]").count() == 0 and await page.locator("img").count() == 0
        assert await page.evaluate("window.pwned === undefined")
        stats = await page.inner_text(".stats")
        assert "TTFT" in stats and "tokens/s" in stats and f"{len(ANSWER)} tokens" in stats and "prompt " in stats
        assert fw.seen[0].tenant == "dev"


# (markdown, the HTML the page's renderer must produce): the injection vectors and the streaming cases
CASES = [
    ("<script>alert(1)</script>", "<p>&lt;script&gt;alert(1)&lt;/script&gt;</p>"),
    ("[x](javascript:alert(1))", "<p>[x](javascript:alert(1))</p>"),
    ('[x](http://a/"onmouseover=alert(1))',
     '<p><a href="http://a/&quot;onmouseover=alert(1" target="_blank" rel="noopener noreferrer">x</a>)</p>'),
    ("`<b>` and **`x`**", "<p><code>&lt;b&gt;</code> and <strong><code>x</code></strong></p>"),
    ("```js\nlet a = 1 < 2;", '<pre><code class="lang-js">let a = 1 &lt; 2;</code></pre>'),  # unclosed: so far
    ("```python extra\nx", "<p>```python extra<br>x</p>"),  # not a fence; must not hang
    ("snake_case_name and 2*3*4", "<p>snake_case_name and 2*3*4</p>"),
    ("3. c\n4. d", '<ol start="3"><li>c</li><li>d</li></ol>'),
    ("a\nb\n\nc", "<p>a<br>b</p><p>c</p>"),
    ("# T\n---\n~~gone~~", "<h1>T</h1><hr><p><del>gone</del></p>"),
]


@pytest.mark.browser
async def test_markdown_renderer_escapes_before_it_formats(encoder):
    async with running_edge(encoder, worker=False) as (edge, _), chromium_page() as page:
        await page.goto(f"http://127.0.0.1:{edge.port}/")
        got = await page.evaluate("(cases) => cases.map((c) => renderMarkdown(c))", [md for md, _ in CASES])
    assert got == [html for _, html in CASES]
