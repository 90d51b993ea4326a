"""The chat page in headless Chromium: type a message, watch streamed text, TTFT and tokens/s."""

from __future__ import annotations

import asyncio
import os

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
