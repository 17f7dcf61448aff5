"""The console at `/` (router/console/page.py) in Debian's chromium, headless, driven by selenium,
against `pdserve up` with a prefill and a decode worker: the page loads without console
errors; a chat message streams the answer the API gives for the same request, with its TTFT
and tokens/s; Stop cancels a stream; the stack view lists the workers, shows the request with
its phases, and a decode worker killed as unhealthy and then back; the page fits 1280x800
and a phone's width. With `--api-keys` and `--admin-key` the page asks for them and uses them.

Skipped, with one line saying why, where chromium, chromedriver or selenium is missing
(`make test` installs Debian's chromium and chromium-driver where it can). With
PDSERVE_SCREENSHOTS=DIR the screenshots are written there (docs/ has the README's).
"""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Iterator

import openai
import pytest

from services.launcher import RouterProcess, free_port
from tests.support.console_browser import (
    By,
    answers,
    ask,
    browser,
    errors,
    screenshot,
    until,
    viewport,
    worker_health,
)
from tests.support.up import Up

MODEL = "SmolLM2-135M-Instruct"
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[tuple[Up, str]]:
    tmp = tmp_path_factory.mktemp("console")
    up = Up(
        "--port",
        str(free_port()),
        "--kv-store",
        f"local://{tmp}/kv",
        "--num-blocks",
        "256",
        "--no-colocated",
    )
    try:
        base = up.ready().removesuffix("/v1")
        yield up, base
    finally:
        up.stop()


def test_the_console_chats_shows_the_stack_and_a_worker_coming_back(stack, tmp_path):
    up, base = stack
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
    api = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": QUESTION}],
        temperature=0,
        max_tokens=24,
        seed=7,
    )
    expected = api.choices[0].message.content
    driver = browser(tmp_path / "profile")
    try:
        driver.get(base + "/")
        assert driver.title == "pdserve console"
        until(lambda: worker_health(driver, "decode") == ["true"], 30, "a healthy decode worker")
        assert worker_health(driver, "prefill") == ["true"]
        assert driver.find_element(By.ID, "model").text == MODEL
        assert "1 prefill, 1 decode" in driver.find_element(By.ID, "topology").text

        ask(driver, QUESTION, 0, 24, 7)  # streamed by the page: the API's answer
        done = until(
            lambda: answers(driver)[0].get_attribute("data-done") == "true", 120, "the answer"
        )
        assert done
        answer = answers(driver)[0]
        assert answer.find_element(By.CLASS_NAME, "content").text == expected.strip()
        stats = answer.find_element(By.CLASS_NAME, "stats").text
        assert re.fullmatch(r"TTFT \d+ ms · \d+ tokens · \d+\.\d tok/s", stats), stats

        # the request in the stack view, with the phases the router recorded
        rows = until(
            lambda: (
                (r := driver.find_elements(By.CSS_SELECTOR, "#requests .request"))
                and len(r) == 2
                and r
            ),
            10,
            "the page's request in the list",
        )
        assert rows[1].get_attribute("data-id") == api.id  # the API's, before
        row = rows[0]
        phases = {
            s.get_attribute("data-phase"): s.get_attribute("title")
            for s in row.find_elements(By.CSS_SELECTOR, ".bar span")
        }
        assert list(phases) == ["queue", "prefill", "transfer", "decode"]
        spent = {p: float(t.split()[1]) for p, t in phases.items()}
        assert spent["prefill"] > 0 and spent["transfer"] > 0 and spent["decode"] > 0
        store = driver.find_element(By.ID, "store").text
        assert re.search(r"hits \d+ · misses \d+ blocks", store), store
        hits = driver.find_element(By.CSS_SELECTOR, ".worker[data-role=decode] .hits").text
        assert re.fullmatch(  # each worker's exact and approximate hits, apart
            r"hits: exact \d+ tokens · approximate 0 tokens "
            r"\(0 chunks kept, 0 read from the store\)",
            hits,
        ), hits
        assert not errors(driver)
        assert driver.execute_script("return [innerWidth, innerHeight]") == [1280, 800]
        screenshot(driver, "console.png", tmp_path)

        # Stop: the stream is cancelled where it is
        ask(driver, "Write a long story about a dragon.", 0.8, 400, 3)
        until(
            lambda: answers(driver)[1].find_element(By.CLASS_NAME, "content").text,
            60,
            "the story's first words",
        )
        driver.find_element(By.ID, "stop").click()
        until(lambda: answers(driver)[1].get_attribute("data-done") == "true", 10, "the stop")
        told = answers(driver)[1].find_element(By.CLASS_NAME, "stats").text
        assert told.endswith("stopped") and int(told.split(" tokens")[0].split()[-1]) < 400
        decode = ".worker[data-role=decode]"
        until(
            lambda: "running 0" in driver.find_element(By.CSS_SELECTOR, decode).text,
            10,
            "the decode worker idle: its work cancelled",
        )

        # a decode worker killed: unhealthy in the view, then back
        pid = int(up.wait_for(r"pdserve: decode-0 started \(pid (\d+)\)", 1).group(1))
        mark = len(up.lines)
        os.kill(pid, signal.SIGKILL)
        until(lambda: worker_health(driver, "decode") == ["false"], 30, "the worker unhealthy")
        assert driver.find_element(By.ID, "status").get_attribute("data-state") == "bad"
        up.wait_for(r"pdserve: decode-0 started", 60, mark)
        until(lambda: worker_health(driver, "decode") == ["true"], 120, "the worker back")
        assert not errors(driver)

        # a phone's width: one column, nothing wider than the window
        viewport(driver, 390, 844, phone=True)
        width = driver.execute_script("return window.innerWidth")
        assert driver.execute_script("return document.documentElement.scrollWidth") <= width
        assert driver.find_element(By.ID, "send").is_displayed()
        screenshot(driver, "console-phone.png", tmp_path)
    finally:
        driver.quit()


def test_with_keys_the_page_asks_for_them_and_uses_them(tmp_path):
    router = RouterProcess(tmp_path, [], [], "--api-keys", "user-key", "--admin-key",
                           "admin-key", "--retry-wait", "1").start(healthy=False)  # fmt: skip
    driver = None
    try:
        driver = browser(tmp_path / "profile")
        driver.get(router.url + "/")
        form = until(
            lambda: (
                driver.find_element(By.ID, "keys").is_displayed()
                and driver.find_element(By.ID, "keys")
            ),
            10,
            "the keys form",
        )
        assert "admin key" in driver.find_element(By.ID, "keys-why").text
        driver.find_element(By.ID, "api-key").send_keys("user-key")
        driver.find_element(By.ID, "admin-key").send_keys("admin-key")
        form.find_element(By.ID, "keys-save").click()
        until(
            lambda: driver.find_element(By.ID, "status").text == "0 of 0 workers healthy",
            10,
            "the stack view with the admin key",
        )
        assert driver.find_element(By.ID, "model").text == MODEL
        assert not driver.find_element(By.ID, "keys").is_displayed()
        ask(driver, QUESTION, 0, 8, 1)  # the API key is taken: no worker, so a 503 told
        until(lambda: answers(driver)[0].get_attribute("data-done") == "true", 30, "the answer")
        message = answers(driver)[0].find_element(By.CLASS_NAME, "content").text
        assert re.search(r"no (prefill|decode) worker is available", message), message
        assert "error" in answers(driver)[0].get_attribute("class")
    finally:
        if driver is not None:
            driver.quit()
        router.stop()
