"""The highlight app in a real browser: headless Chromium driven by Selenium.

Needs Debian's ``chromium`` and ``chromium-driver`` and the ``selenium`` package; ``make
test-browser`` installs them and runs this file (with ``KVEDIT_REQUIRE_BROWSER=1``, so a missing
browser fails instead of skipping). Under ``make test`` the file is skipped where Chromium is
absent. The model is ``KVEDIT_BROWSER_MODEL`` (default: the bundled SmolLM2, so the screenshot
shows real answers). Screenshots go to ``runs/screenshots/``.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from test_app import REPO, start_app, stop_app

MODEL = os.environ.get("KVEDIT_BROWSER_MODEL", "smollm2-135m-instruct")
# The app runs the bundled model in a subprocess by default, which the conftest check cannot see.
pytestmark = pytest.mark.real
SCREENSHOTS = REPO / "runs" / "screenshots"
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--window-size=1400,1000",
)
RUN_TIMEOUT = 180  # seconds for one Run on 2 CPU cores


def _browser_or_skip() -> tuple[str, str]:
    """Paths of Chromium and chromedriver; skip (or fail under make test-browser) without them."""
    chromium = os.environ.get("KVEDIT_CHROMIUM") or next(
        filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None
    )
    driver = os.environ.get("KVEDIT_CHROMEDRIVER") or shutil.which("chromedriver")
    missing = [
        name for name, path in (("chromium", chromium), ("chromedriver", driver)) if not path
    ]
    try:
        import selenium  # noqa: F401
    except ModuleNotFoundError:
        missing.append("selenium")
    if missing:
        reason = f"{', '.join(missing)} not installed (make test-browser installs them)"
        if os.environ.get("KVEDIT_REQUIRE_BROWSER"):
            pytest.fail(reason)
        pytest.skip(reason)
    return chromium, driver


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    chromium, driver_path = _browser_or_skip()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}")
    driver = webdriver.Chrome(service=Service(executable_path=driver_path), options=options)
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture(scope="module")
def page(browser, tmp_path_factory):
    """The app's page, served by ``kvedit app`` on localhost and loaded in the browser."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    proc, url = start_app(MODEL, tmp_path_factory.mktemp("app") / "server.log")
    try:
        browser.get(url)
        WebDriverWait(browser, 60).until(
            lambda d: d.find_elements(By.CSS_SELECTOR, "#context textarea")
        )
        yield browser
    finally:
        stop_app(proc)


# ------------------------------------------------------------------------------------- helpers


def field(driver, elem_id: str):
    from selenium.webdriver.common.by import By

    return driver.find_element(By.CSS_SELECTOR, f"#{elem_id} textarea, #{elem_id} input")


def value(driver, elem_id: str) -> str:
    return field(driver, elem_id).get_property("value")


def type_into(driver, elem_id: str, text: str) -> None:
    """Replace a box's text by typing, as a user would (``clear()`` alone fires no input event,
    so Gradio would keep the old value when ``text`` is empty)."""
    from selenium.webdriver.common.keys import Keys

    box = field(driver, elem_id)
    box.clear()
    box.send_keys(" ", Keys.BACKSPACE)
    box.send_keys(text)


def text_of(driver, elem_id: str) -> str:
    from selenium.webdriver.common.by import By

    return driver.find_element(By.ID, elem_id).text


def click(driver, elem_id: str) -> None:
    from selenium.webdriver.common.by import By

    driver.find_element(By.ID, elem_id).click()


def wait_for(driver, condition, timeout: float = RUN_TIMEOUT):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout, poll_frequency=0.25).until(lambda d: condition(d))


def run_and_wait(driver, timeout: float = RUN_TIMEOUT) -> str:
    """Press Run and return the status text once the request is answered.

    Done means the status box's progress tracker is hidden again after it was shown (or, for a
    request too quick to catch pending, the status text changed).
    """
    import time

    from selenium.webdriver.common.by import By

    def tracker_hidden() -> bool:
        tracker = driver.find_element(By.CSS_SELECTOR, "#status [data-testid='status-tracker']")
        return "hide" in (tracker.get_attribute("class") or "").split()

    old = text_of(driver, "status")
    click(driver, "run")
    saw_pending = False
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        hidden = tracker_hidden()
        saw_pending |= not hidden
        status = text_of(driver, "status")
        if hidden and (saw_pending or status != old):
            return status
        time.sleep(0.05)
    raise TimeoutError(f"no answer within {timeout} s; status: {text_of(driver, 'status')!r}")


def screenshot(driver, name: str) -> Path:
    """A screenshot of the whole page (the window is grown to the page's height)."""
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    height = driver.execute_script("return document.documentElement.scrollHeight")
    driver.set_window_size(1400, max(1000, min(int(height) + 40, 4000)))
    path = SCREENSHOTS / name
    assert driver.save_screenshot(str(path))
    return path


# --------------------------------------------------------------------------------------- tests


def test_context_and_span_give_both_answers(page):
    type_into(
        page,
        "context",
        "The museum opens at 9 am on weekdays. The cafe opens at 7 am. "
        "The library opens at 11 am on Sundays.",
    )
    type_into(page, "emphasize", "The library opens at 11 am on Sundays.")
    type_into(page, "suppress", "")
    type_into(page, "question", "When does the library open on Sundays?")
    status = run_and_wait(page)
    assert status.startswith("Done in"), status
    assert value(page, "baseline").strip() and value(page, "steered").strip()
    after = page.find_element("id", "after").get_attribute("innerHTML")
    assert "background:rgba(" in after  # tokens coloured by attention
    assert "border-bottom:3px solid" in after  # the emphasized span underlined
    assert "The library opens" in text_of(page, "before")
    screenshot(page, "highlight-custom.png")


def test_missing_span_is_reported_in_the_page(page):
    type_into(page, "emphasize", "The zoo opens at noon.")
    status = run_and_wait(page)
    assert "not found in the context" in status and "The zoo opens at noon." in status
    assert value(page, "baseline") == "" and value(page, "steered") == ""
    assert "Traceback" not in page.find_element("tag name", "body").text


def test_selected_text_becomes_a_span(page):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.keys import Keys

    context = value(page, "context")
    start = context.index("The cafe")
    length = len("The cafe opens at 7 am.")
    type_into(page, "emphasize", "The museum opens at 9 am on weekdays.")
    box = field(page, "context")
    box.click()
    box.send_keys(Keys.CONTROL, Keys.HOME)
    (  # select with the keyboard, as a user would
        ActionChains(page)
        .send_keys(Keys.ARROW_RIGHT * start)
        .key_down(Keys.SHIFT)
        .send_keys(Keys.ARROW_RIGHT * length)
        .key_up(Keys.SHIFT)
        .perform()
    )
    page.find_element("xpath", "//button[normalize-space()='Emphasize selection']").click()
    want = "The museum opens at 9 am on weekdays.\nThe cafe opens at 7 am."
    wait_for(page, lambda d: value(d, "emphasize") == want, timeout=30)
    # Without a selection the page says what to do.
    box.click()
    box.send_keys(Keys.CONTROL, Keys.END)
    page.find_element("xpath", "//button[normalize-space()='Suppress selection']").click()
    wait_for(page, lambda d: "select some text" in text_of(d, "status"), timeout=30)
    assert value(page, "suppress") == ""


def test_sample_run_and_screenshot(page):
    click(page, "load-sample")
    wait_for(page, lambda d: "secret number" in value(d, "context"), timeout=30)
    gold = value(page, "emphasize")
    assert gold and gold in value(page, "context")
    assert "Gold record" in text_of(page, "hint") and gold in text_of(page, "hint")
    assert value(page, "question").startswith("What is ")
    status = run_and_wait(page)
    assert status.startswith("Done in"), status
    baseline, steered = value(page, "baseline"), value(page, "steered")
    assert baseline.strip() and steered.strip()
    page.execute_script("window.scrollTo(0, 0)")
    path = screenshot(page, "highlight.png")
    assert path.stat().st_size > 20_000  # a rendered page, not a blank one


def test_auto_highlight_fills_the_emphasize_box(page):
    from selenium.webdriver.common.by import By

    old = value(page, "context")
    click(page, "load-sample")
    wait_for(page, lambda d: value(d, "context") not in ("", old), timeout=30)
    context, question = value(page, "context"), value(page, "question")
    type_into(page, "emphasize", "My own span")
    type_into(page, "question", "")
    # An error leaves the typed spans alone.
    click(page, "auto-highlight")
    wait_for(page, lambda d: "Ask a question" in text_of(d, "status"))
    assert value(page, "emphasize") == "My own span"

    type_into(page, "emphasize", "")
    type_into(page, "question", question)

    def rows(d):
        return d.find_elements(By.CSS_SELECTOR, "#focus-scores li")

    click(page, "auto-highlight")
    wait_for(page, lambda d: value(d, "emphasize").strip() and rows(d))
    status = text_of(page, "status")
    assert status.startswith("Auto-highlight in") and "picked 1 of" in status, status
    picked = value(page, "emphasize")
    lines = [line for line in context.split("\n") if line.strip()]
    assert picked in lines  # one record (or the instruction), as the Emphasize box takes it
    assert len(rows(page)) == len(lines)  # a row per passage: the instruction and each record
    (chosen,) = page.find_elements(By.CSS_SELECTOR, "#focus-scores li.chosen")
    assert chosen.get_attribute("title") == picked and "✓" in chosen.text
    assert "Passage scores" in text_of(page, "focus-scores")

    status = run_and_wait(page)  # the picked passage steers like a typed one
    assert status.startswith("Done in"), status
    page.execute_script("window.scrollTo(0, 0)")
    screenshot(page, "highlight-auto.png")


# ------------------------------------------------------------------------------ the Memory tab

MEMORY_TURNS = (
    "My dog's name is Biscuit.",
    "My locker code is 4821.",
    "What is my dog's name?",
)


def choose(driver, elem_id: str, option: str) -> None:
    """Pick ``option`` in a Gradio dropdown, as a user would: type it and press Enter."""
    from selenium.webdriver.common.keys import Keys

    box = field(driver, elem_id)
    box.click()
    box.send_keys(Keys.CONTROL, "a")
    box.send_keys(option)
    box.send_keys(Keys.ENTER)
    wait_for(driver, lambda d: value(d, elem_id) == option, timeout=30)
    box.send_keys(Keys.TAB)


def test_memory_tab_charts_each_turn_and_draws_a_forgotten_message(page):
    """Three turns typed into the Memory tab, under a byte budget that forgets by recency: the
    chart has a row per message after each turn, and the oldest user message ends forgotten."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    page.execute_script("window.scrollTo(0, 0)")
    page.find_element(By.XPATH, "//button[@role='tab' and normalize-space()='Memory']").click()
    wait_for(page, lambda d: d.find_element(By.ID, "mem-chat").is_displayed(), timeout=30)
    type_into(page, "mem-budget", "2700")  # about 60 entries per layer of SmolLM2 (float32)
    choose(page, "mem-forget", "window")

    def rows(d):
        return d.find_elements(By.CSS_SELECTOR, "#mem-chart tr.message")

    charts = []
    for n, text in enumerate(MEMORY_TURNS, 1):
        type_into(page, "mem-message", text)
        field(page, "mem-message").send_keys(Keys.ENTER)
        wait_for(page, lambda d, n=n: text_of(d, "mem-status").startswith(f"Turn {n}:"))
        assert len(rows(page)) == 2 * n + 1  # the system message, then a question and answer each
        chart = page.find_element(By.ID, "mem-chart").get_attribute("innerHTML")
        assert chart not in charts
        charts.append(chart)
        assert "forgetting by window" in text_of(page, "mem-status")
    states = [r.get_attribute("class").split()[-1] for r in rows(page)]
    assert states[0] == "kept" and states[1] == "forgotten", states
    first = rows(page)[1].find_element(By.CSS_SELECTOR, "td.label")
    assert first.value_of_css_property("text-decoration-line") == "line-through"
    assert len(page.find_elements(By.CSS_SELECTOR, "#mem-chat .message, #mem-chat [data-testid]"))
    screenshot(page, "highlight-memory.png")
