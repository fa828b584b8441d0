"""A real headless Chromium for the tests that read the MLflow UI (Debian's chromium and
chromium-driver, driven by Selenium), and where their screenshots go."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ARTIFACTS = REPO / "test-artifacts"  # screenshots; the ones in docs/figures/ui/ are copied from here


def chromium() -> tuple[str, str]:
    """Debian's chromium and chromium-driver, installed here if missing (as root, with apt-get)."""
    browser, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if not (browser and driver):
        assert os.geteuid() == 0 and shutil.which("apt-get"), (
            "the browser tests need Debian's chromium and chromium-driver: apt-get install chromium chromium-driver"
        )
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(["apt-get", "update"], env=env, check=True, capture_output=True, timeout=600)
        subprocess.run(
            ["apt-get", "install", "-y", "--no-install-recommends", "chromium", "chromium-driver"],
            env=env,
            check=True,
            capture_output=True,
            timeout=900,
        )
        browser, driver = shutil.which("chromium"), shutil.which("chromedriver")
    return browser, driver


@contextlib.contextmanager
def browser(basic_auth: str | None = None):
    """A headless Chromium (1600×1000), sending ``Authorization: Basic <basic_auth>`` when given."""
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    binary, driver = chromium()
    opts = Options()
    for a in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--window-size=1600,1000"):
        opts.add_argument(a)
    opts.binary_location = binary
    d = webdriver.Chrome(service=Service(driver), options=opts)
    try:
        if basic_auth:
            d.execute_cdp_cmd("Network.enable", {})
            d.execute_cdp_cmd("Network.setExtraHTTPHeaders", {"headers": {"Authorization": "Basic " + basic_auth}})
        yield d
    finally:
        d.quit()


def page_text(d) -> str:
    from selenium.webdriver.common.by import By

    return d.find_element(By.TAG_NAME, "body").text


def wait_for_text(d, *needles: str, timeout: float = 90) -> str:
    """The page's text once every needle is in it (the UI renders after its API calls)."""
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        WebDriverWait(d, timeout).until(lambda _: all(n in page_text(d) for n in needles))
    except TimeoutException as e:  # say what the page showed instead (and keep a picture of it)
        shot = screenshot(d, "timeout.png")
        missing = [n for n in needles if n not in page_text(d)]
        raise AssertionError(
            f"after {timeout} s, {missing} not on {d.current_url} ({shot}); it shows:\n{page_text(d)[-3000:]}"
        ) from e
    return page_text(d)


def screenshot(d, name: str) -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / name
    d.save_screenshot(str(path))
    assert path.stat().st_size > 10_000, path
    return path


def scroll_to(d, text: str) -> None:
    """Bring the element whose text is ``text`` to the middle of the window (for a screenshot)."""
    from selenium.webdriver.common.by import By

    d.execute_script(
        "arguments[0].scrollIntoView({block: 'center'});", d.find_element(By.XPATH, f"//*[text()='{text}']")
    )
