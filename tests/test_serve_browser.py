"""The chat page in a real headless Chromium (the system package, driven by Selenium through the system
chromedriver): a typed question gets the embedded model's streamed answer, the demo picture gets "triangle",
and the plan and live telemetry are on the page. Set STREAMOE_SCREENSHOT=PATH to keep a screenshot."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from streamoe.convert.convert import convert
from streamoe.runtime.engine import Engine, Options
from streamoe.runtime.plan import MiB

from .serve_util import TINY, chat_ids, greedy, quarter_cap, start_server, stop_server, triangle_png

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(CHROMIUM is None or DRIVER is None,
                                reason="no system Chromium and chromedriver (apt-get install chromium chromium-driver; "
                                       ".ci/run installs them)")


@pytest.fixture(scope="module")
def conv(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("browser") / "tiny"
    convert(TINY, out, formats=["q4"], progress=False)
    return out


@pytest.fixture(scope="module")
def server(conv, tmp_path_factory):
    cap = quarter_cap(conv, 1024, 256, cache_mib=8)  # experts stream: the telemetry has something to show
    s = start_server(conv, tmp_path_factory.mktemp("log") / "serve.log", "--cap", cap, "--ctx", 1024, "--runtime-mib", 256,
                     "--prompt-cache-mib", 8)
    yield s
    stop_server(s)


@pytest.fixture(scope="module")
def browser():
    pytest.importorskip("selenium", reason="selenium is a [dev] dependency (pip install -e '.[dev]')")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1280,860"):
        opts.add_argument(arg)
    driver = webdriver.Chrome(service=Service(DRIVER), options=opts)
    driver.set_page_load_timeout(30)
    yield driver
    driver.quit()


def ask(browser, text: str, n: int) -> object:
    """Type a question, press Enter, wait for the n-th answer to finish streaming; returns its element."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait

    box = browser.find_element(By.ID, "prompt")
    box.send_keys(text)
    box.send_keys(Keys.ENTER)
    done = ".msg.assistant[data-state=done], .msg.assistant[data-state=error]"
    WebDriverWait(browser, 120).until(lambda d: len(d.find_elements(By.CSS_SELECTOR, done)) >= n)
    answer = browser.find_elements(By.CSS_SELECTOR, ".msg.assistant")[n - 1]
    assert answer.get_attribute("data-state") == "done", answer.text
    return answer


def test_chat_page_answers_streams_and_shows_the_plan(server, browser, conv, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(server.url + "/")
    WebDriverWait(browser, 30).until(lambda d: d.find_element(By.ID, "status").text == "ready")
    plan = {r.find_element(By.TAG_NAME, "th").text: r.find_element(By.TAG_NAME, "td").text
            for r in browser.find_elements(By.CSS_SELECTOR, "#plan tr")}
    assert {"non-expert", "kv cache", "prompt cache", "requests", "runtime", "hot tier", "total"} <= set(plan)
    assert plan["prompt cache"] == "8.0 MiB"

    browser.find_element(By.ID, "temperature").send_keys("0")
    question = "What colour is the shape?"
    answer = ask(browser, question, 1)
    eng = Engine(conv, Options(cap_gib=8, ctx=1024, runtime_bytes=256 * MiB))
    said = eng.text.decode(greedy(eng, chat_ids(eng, [{"role": "user", "content": question}], think=True), 256))
    eng.close()
    assert answer.find_element(By.CLASS_NAME, "content").text == said.split("</think>")[-1].strip()
    assert int(answer.get_attribute("data-chunks")) >= 1  # it came as a stream of events
    assert "tokens" in answer.find_element(By.CLASS_NAME, "meta").text
    assert browser.find_element(By.ID, "t-toks").text not in ("", "–")
    read, busy = browser.find_element(By.ID, "t-read").text, browser.find_element(By.ID, "t-busy").text
    assert busy == "–" if read == "0.00" else busy.endswith(" %"), (read, busy)  # the disk's share only when it read
    assert " of " in browser.find_element(By.ID, "t-mem").text

    browser.find_element(By.ID, "new").click()
    picture = triangle_png(tmp_path / "triangle.png")
    browser.find_element(By.ID, "image").send_keys(str(picture))
    WebDriverWait(browser, 10).until(lambda d: d.find_element(By.ID, "attached").text == "triangle.png")
    browser.find_element(By.ID, "think").click()  # thinking off: the answer alone
    answer = ask(browser, "What shape is in the image?", 1)
    assert answer.find_element(By.CLASS_NAME, "content").text == "triangle"
    assert answer.find_element(By.TAG_NAME, "details").get_attribute("open") is None  # thinking stays collapsed
    assert browser.find_elements(By.CSS_SELECTOR, ".msg.user img")  # the attached picture is shown
    shot = os.environ.get("STREAMOE_SCREENSHOT")
    browser.save_screenshot(shot or str(tmp_path / "chat-page.png"))
    assert Path(shot or tmp_path / "chat-page.png").stat().st_size > 10_000
