"""The console with a model that reads images (a tiny random Gemma 3 with its vision tower)
served by `pdserve up --num-encode 1`, in headless chromium: the stack view shows the encoder
and counts what it encoded; an image picked with the file button, or pasted into the prompt,
goes with the question, shows as a thumbnail, and the answer is the API's for the same
message (temperature 0). Skipped where chromium is missing (tests/support/console_browser.py).
"""

from __future__ import annotations

import base64

import openai
import pytest

from services.launcher import free_port
from tests.support.console_browser import By, answers, browser, errors, screenshot, until
from tests.support.tiny_vision import picture, save_tiny_gemma3_vision
from tests.support.up import Up


@pytest.fixture(scope="module")
def stack(tmp_path_factory, embedded_dir):
    tmp = tmp_path_factory.mktemp("console-images")
    save_tiny_gemma3_vision(tmp / "model", embedded_dir)
    up = Up("--port", str(free_port()), "--model", str(tmp / "model"), "--dtype", "float32",
            "--kv-store", f"local://{tmp}/kv", "--num-blocks", "256",
            "--num-encode", "1")  # fmt: skip
    try:
        yield up.ready().removesuffix("/v1"), tmp
    finally:
        up.stop()


def api_answer(base: str, image: bytes, text: str) -> str:
    """The API's answer to what the page sends: the image first, then the text."""
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
    url = "data:image/png;base64," + base64.b64encode(image).decode()
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}]
    reply = client.chat.completions.create(
        model=client.models.list().data[0].id, messages=[{"role": "user", "content": content}],
        temperature=0, max_tokens=12, seed=5,
    )  # fmt: skip
    return reply.choices[0].message.content.strip()


def settle(driver) -> None:
    settings = driver.find_element(By.ID, "settings")
    if not settings.get_attribute("open"):
        settings.find_element(By.TAG_NAME, "summary").click()
    for field, value in (("temperature", 0), ("max-tokens", 12), ("seed", 5)):
        box = driver.find_element(By.ID, field)
        box.clear()
        box.send_keys(str(value))


PASTE = """
const [data, area] = arguments;
const bytes = Uint8Array.from(atob(data), (c) => c.charCodeAt(0));
const transfer = new DataTransfer();
transfer.items.add(new File([bytes], "pasted.png", { type: "image/png" }));
area.dispatchEvent(new ClipboardEvent("paste", { clipboardData: transfer, bubbles: true,
                                                 cancelable: true }));
"""


def test_an_image_picked_or_pasted_goes_with_the_question(stack, tmp_path):
    base, tmp = stack
    picked, pasted = picture(1, (40, 60)), picture(2, (40, 60))
    (tmp / "picked.png").write_bytes(picked)
    driver = browser(tmp_path / "profile")
    try:
        driver.get(base + "/")
        until(lambda: driver.find_elements(By.CSS_SELECTOR, ".worker[data-role=encode]"), 30,
              "the encoder in the stack view")  # fmt: skip
        until(lambda: driver.find_element(By.ID, "attach").is_displayed(), 10, "the button")
        settle(driver)

        driver.find_element(By.ID, "image-file").send_keys(str(tmp / "picked.png"))
        until(lambda: driver.find_elements(By.CSS_SELECTOR, "#attached .thumb"), 10, "a thumb")
        driver.find_element(By.ID, "prompt").send_keys("What is in it?")
        driver.find_element(By.ID, "send").click()
        until(lambda: answers(driver)[0].get_attribute("data-done") == "true", 60, "an answer")
        said = answers(driver)[0].find_element(By.CLASS_NAME, "content").text
        assert said == api_answer(base, picked, "What is in it?")
        assert driver.find_elements(By.CSS_SELECTOR, ".message.user .thumb")
        assert not driver.find_elements(By.CSS_SELECTOR, "#attached .thumb")  # sent: cleared
        encoder = ".worker[data-role=encode]"
        until(lambda: "images encoded 1" in driver.find_element(By.CSS_SELECTOR, encoder).text,
              10, "the encoder's count")  # fmt: skip

        driver.find_element(By.ID, "clear").click()
        area = driver.find_element(By.ID, "prompt")
        driver.execute_script(PASTE, base64.b64encode(pasted).decode(), area)
        until(lambda: driver.find_elements(By.CSS_SELECTOR, "#attached .thumb"), 10, "a thumb")
        area.send_keys("And this?")
        driver.find_element(By.ID, "send").click()
        until(lambda: answers(driver)[0].get_attribute("data-done") == "true", 60, "an answer")
        said = answers(driver)[0].find_element(By.CLASS_NAME, "content").text
        assert said == api_answer(base, pasted, "And this?")
        assert not errors(driver)
        screenshot(driver, "console-images.png", tmp_path)
    finally:
        driver.quit()
