"""Driving the console in Debian's chromium, headless, with selenium: the browser, waits,
its console errors, screenshots, and the page's chat and stack view as a test reads them.

Importing this skips the importing test module, with one line saying why, where chromium,
chromedriver or selenium is missing (`make test` installs Debian's chromium and
chromium-driver where it can).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

CHROMIUM, DRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"

missing = [p for p in (CHROMIUM, DRIVER) if not os.path.exists(p)]
if missing:
    pytest.skip(
        f"no {' or '.join(missing)}: apt-get install chromium chromium-driver to run "
        "the console's browser tests",
        allow_module_level=True,
    )
webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed")
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402


def browser(tmp: Path, width: int = 1280, height: int = 800) -> Any:
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-sync",
        "--disable-component-update",
        "--disable-dev-shm-usage",
        f"--user-data-dir={tmp}",
        f"--window-size={width},{height}",
    ):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    os.environ.setdefault("SE_AVOID_STATS", "true")  # selenium: nothing sent anywhere
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    viewport(driver, width, height)
    return driver


def viewport(driver: Any, width: int, height: int, phone: bool = False) -> None:
    """The page's own size (a headless window's size counts its frame)."""
    driver.execute_cdp_cmd(
        "Emulation.setDeviceMetricsOverride",
        {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": phone},
    )


def until(check: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = check()
        except Exception:  # the page between two renders: a node replaced
            value = None
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"waited {timeout:g}s for {what}")


def errors(driver: Any) -> list[dict[str, Any]]:
    return [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def screenshot(driver: Any, name: str, tmp: Path) -> Path:
    folder = Path(os.environ.get("PDSERVE_SCREENSHOTS") or tmp)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    driver.save_screenshot(str(path))
    assert path.stat().st_size > 10_000
    return path


def ask(driver: Any, text: str, temperature: float, max_tokens: int, seed: int) -> None:
    settings = driver.find_element(By.ID, "settings")
    if not settings.get_attribute("open"):
        settings.find_element(By.TAG_NAME, "summary").click()
    for field, value in (("temperature", temperature), ("max-tokens", max_tokens), ("seed", seed)):
        box = driver.find_element(By.ID, field)
        box.clear()
        box.send_keys(str(value))
    driver.find_element(By.ID, "prompt").send_keys(text)
    driver.find_element(By.ID, "send").click()


def answers(driver: Any) -> list[Any]:
    return driver.find_elements(By.CSS_SELECTOR, ".message.assistant")


def worker_health(driver: Any, role: str) -> list[str]:
    cards = driver.find_elements(By.CSS_SELECTOR, f".worker[data-role={role}]")
    return [c.get_attribute("data-healthy") for c in cards]
