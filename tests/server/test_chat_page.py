"""The chat page in headless Chromium (Debian `chromium`, driven by playwright through its path)."""

from __future__ import annotations

import re
import shutil
import time
from typing import Any

import pytest
from live_server import API_KEY, MODEL, LiveServer
from playwright.sync_api import expect, sync_playwright

# Wraps the page's fetch so the baby model cannot end the answer by itself before Stop.
LONG_ANSWERS = """() => {
  const fetch0 = window.fetch.bind(window);
  window.fetch = (url, options) => {
    if (options && options.body) {
      const body = { ...JSON.parse(options.body), ignore_eos: true };
      options = { ...options, body: JSON.stringify(body) };
    }
    return fetch0(url, options);
  };
}"""


def _chromium() -> str:
    # Not a skip: CI installs the browser, so its absence is a broken environment.
    for name in ("chromium", "chromium-browser"):
        path = shutil.which(name)
        if path:
            return path
    pytest.fail("no chromium executable on PATH: `python tests/provision.py` installs it")


def test_page_streams_an_answer_over_two_turns(server: LiveServer) -> None:
    questions = ["Hello! How are you today?", "What is your name?"]
    history: list[dict[str, str]] = []
    expected = []
    for question in questions:  # what the API answers greedily to the same conversation
        history.append({"role": "user", "content": question})
        reply = server.openai().chat.completions.create(
            model=MODEL, messages=history, max_tokens=12, temperature=0
        )
        expected.append(reply.choices[0].message.content or "")
        history.append({"role": "assistant", "content": expected[-1]})

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=_chromium(), headless=True)
        try:
            page = browser.new_page()
            page.goto(server.url + "/")
            expect(page.locator("#model")).to_contain_text("401")  # no key yet
            page.fill("#api-key", API_KEY)
            page.dispatch_event("#api-key", "change")
            expect(page.locator("#model")).to_have_text(MODEL)
            page.fill("#max-tokens", "12")
            page.fill("#temperature", "0")
            for turn, question in enumerate(questions):
                page.fill("#prompt", question)
                page.click("#send")
                answer = page.locator(".msg.assistant").nth(turn)
                expect(answer).to_have_attribute("data-state", "done", timeout=20_000)
                expect(answer).to_have_text(expected[turn])
                expect(page.locator("#status")).to_have_text(
                    re.compile(r"^\d+ tokens \((stop|length)\)(, [\d.]+ tokens/s)?")
                )
            expect(page.locator(".msg.user")).to_have_text(questions)
            expect(page.locator(".msg.error")).to_have_count(0)
        finally:
            browser.close()


def test_stop_button_cancels_the_stream(server: LiveServer,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    # 10 ms per decode step: 200 baby-model tokens would otherwise end in well under a second,
    # sometimes before the browser clicks Stop.
    step = server.service.runner.step

    def slow_step(plan: Any) -> Any:
        time.sleep(0.01)
        return step(plan)

    monkeypatch.setattr(server.service.runner, "step", slow_step)
    server.wait_for("hetmoe_running_requests", 0)
    generated_before = server.metric("hetmoe_generated_tokens_total")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=_chromium(), headless=True)
        try:
            page = browser.new_page()
            page.goto(server.url + "/")
            page.fill("#api-key", API_KEY)
            page.dispatch_event("#api-key", "change")
            expect(page.locator("#model")).to_have_text(MODEL)
            page.fill("#max-tokens", "200")
            page.evaluate(LONG_ANSWERS)
            page.fill("#prompt", "Tell me a long story.")
            page.click("#send")
            expect(page.locator(".msg.assistant")).not_to_have_text("")  # streaming has begun
            page.click("#stop")
            expect(page.locator("#status")).to_have_text("stopped")
            expect(page.locator("#send")).to_be_enabled()
            expect(page.locator(".msg.error")).to_have_count(0)
            server.wait_for("hetmoe_running_requests", 0)
            stopped_at = server.metric("hetmoe_generated_tokens_total")
        finally:
            browser.close()
    assert stopped_at - generated_before < 200, "the answer ran to its end: stop did not cancel"
