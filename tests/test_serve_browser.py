"""The chat page in a real headless Chromium (the system package, driven by Selenium through the system
chromedriver): a typed question gets the embedded model's streamed answer, the demo picture gets "triangle",
the plan and live telemetry are on the page, Stop and New chat end the generation on the server, and the page
works at 360 px. Set STREAMOE_SCREENSHOT=PATH to keep the desktop screenshot (docs/chat-page.png is one)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from streamoe.runtime.engine import Engine, Options, plan_for
from streamoe.runtime.plan import MiB

from .serve_util import chat_ids, fetch, greedy, quarter_cap, start_server, stop_server, triangle_png

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(CHROMIUM is None or DRIVER is None,
                                reason="no system Chromium and chromedriver (apt-get install chromium chromium-driver; "
                                       ".ci/run installs them)")


@pytest.fixture(scope="module")
def conv(trained_conv) -> Path:
    return trained_conv


@pytest.fixture(scope="module")
def server(conv, tmp_path_factory):
    cap = quarter_cap(conv, 1024, 256, cache_mib=8)  # experts stream: the telemetry has something to show
    s = start_server(conv, tmp_path_factory.mktemp("log") / "serve.log", "--cap", cap, "--ctx", 1024, "--runtime-mib", 256,
                     "--prompt-cache-mib", 8)
    yield s
    stop_server(s)


@pytest.fixture(scope="module")
def endless(tiny_conv, tmp_path_factory):
    """A server of a random-weight checkpoint: its answers run to max_tokens (the trained model stops within a
    few tokens), so there is always something to stop."""
    cap = quarter_cap(tiny_conv, 1024, 256, cache_mib=8)
    s = start_server(tiny_conv, tmp_path_factory.mktemp("log") / "endless.log", "--cap", cap, "--ctx", 1024,
                     "--runtime-mib", 256, "--prompt-cache-mib", 8)
    yield s
    stop_server(s)


@pytest.fixture(scope="module")
def browser():
    pytest.importorskip("selenium", reason="selenium is a [dev] dependency (pip install -e '.[dev]')")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})  # the console, read by the tests
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


PNG = b"\x89PNG\r\n\x1a\n"


def screenshot(browser, path: Path) -> Path:
    """A screenshot of the page as headless Chromium renders it: a real PNG, not an empty one."""
    assert browser.save_screenshot(str(path))
    data = path.read_bytes()
    assert data.startswith(PNG) and len(data) > 10_000, len(data)
    return path


def open_page(browser, server) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(server.url + "/")
    WebDriverWait(browser, 30).until(lambda d: d.find_element(By.ID, "status").text == "ready")


def start_long_answer(browser, text: str, n: int) -> object:
    """Ask for a 700-token answer and wait until the n-th answer is streaming; returns its element."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait

    for field, value in (("max-tokens", "700"), ("temperature", "0")):
        box = browser.find_element(By.ID, field)
        box.clear()
        box.send_keys(value)
    box = browser.find_element(By.ID, "prompt")
    box.send_keys(text)
    box.send_keys(Keys.ENTER)

    def streaming(d):
        answers = d.find_elements(By.CSS_SELECTOR, ".msg.assistant")
        return len(answers) >= n and answers[n - 1].get_attribute("data-state") == "streaming" \
            and int(answers[n - 1].get_attribute("data-chunks") or 0) >= 2 and answers[n - 1]
    return WebDriverWait(browser, 60, poll_frequency=0.02).until(streaming)


def cancelled_in_log(server, count: int, timeout: float = 10) -> list[int]:
    """Wait until the server log says `count` generations were cancelled; their token counts."""
    import re
    import time

    end = time.time() + timeout
    while True:
        got = [int(n) for n in re.findall(r"cancelled after (\d+) tokens", server.text())]
        if len(got) >= count or time.time() > end:
            return got
        time.sleep(0.05)


def test_chat_page_answers_streams_and_shows_the_plan(server, browser, conv, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(server.url + "/")
    WebDriverWait(browser, 30).until(lambda d: d.find_element(By.ID, "status").text == "ready")
    plan = {r.find_element(By.TAG_NAME, "th").text: r.find_element(By.TAG_NAME, "td").text
            for r in browser.find_elements(By.CSS_SELECTOR, "#plan tr")}
    assert {"non-expert", "kv cache", "prompt cache", "requests", "runtime", "hot tier", "total"} <= set(plan)
    assert plan["prompt cache"] == "8.0 MiB"
    served = fetch(server.url + "/v1/plan").json()  # the hot tier's slots at the slot's size, as the server plans them
    assert plan["hot tier"] == f"{served['hot_slots'] * served['slot'] / MiB:.1f} MiB" and served["slot"] != served["stride"]

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
    screenshot(browser, Path(os.environ.get("STREAMOE_SCREENSHOT") or tmp_path / "chat-page.png"))
    assert [e for e in browser.get_log("browser") if e["level"] == "SEVERE"] == []  # no 404 (a favicon), no error


def test_the_page_asks_for_the_api_key_once(browser, tiny_conv, tmp_path):
    """A server started with --api-key: the page asks for the key when the API first answers 401 (again after a
    wrong one), then loads the plan and answers with it (every later call sends it)."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions
    from selenium.webdriver.support.ui import WebDriverWait

    cap = quarter_cap(tiny_conv, 1024, 256, cache_mib=8)
    s = start_server(tiny_conv, tmp_path / "keyed.log", "--cap", cap, "--ctx", 1024, "--runtime-mib", 256,
                     "--prompt-cache-mib", 8, "--api-key", "page-key-7")
    try:
        browser.get(s.url + "/")
        WebDriverWait(browser, 30).until(expected_conditions.alert_is_present())
        alert = browser.switch_to.alert
        assert "API key" in alert.text
        alert.send_keys("a-wrong-key")  # asked again (the next call), then the plan loads whole
        alert.accept()
        WebDriverWait(browser, 30).until(expected_conditions.alert_is_present())
        alert = browser.switch_to.alert
        alert.send_keys("page-key-7")
        alert.accept()
        WebDriverWait(browser, 30).until(lambda d: d.find_element(By.ID, "status").text == "ready")
        WebDriverWait(browser, 30).until(lambda d: d.find_elements(By.CSS_SELECTOR, "#plan tr"))
        assert browser.find_element(By.ID, "model").text.startswith(tiny_conv.name + " · cap ")
        browser.find_element(By.ID, "max-tokens").send_keys("4")
        ask(browser, "hi", 1)  # the streamed answer (and the stats polled beside it) with the key, no question asked
        after = s.text().split('"GET /v1/plan HTTP/1.1" 200', 1)[1]  # from the plan's load with the right key
        assert '" 401' not in after and '"POST /v1/chat/completions HTTP/1.1" 200' in after, after
    finally:
        browser.execute_script("sessionStorage.clear()")
        stop_server(s)


def test_stop_cancels_the_generation_on_the_server(endless, browser):
    """Stop aborts the stream; the server stops generating at its next token (its log says so, /v1/stats is
    idle again) and the page can ask again at once."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    from .serve_util import fetch

    open_page(browser, endless)
    before = len(cancelled_in_log(endless, 0, 0))
    assert browser.find_element(By.ID, "stop").get_attribute("disabled")  # nothing to stop yet
    answer = start_long_answer(browser, "Write a long story about a shape.", 1)
    assert browser.find_element(By.ID, "send").get_attribute("disabled")
    browser.find_element(By.ID, "stop").click()
    WebDriverWait(browser, 10).until(lambda d: answer.get_attribute("data-state") == "stopped")
    assert answer.find_element(By.CLASS_NAME, "meta").text == "stopped"
    stopped = cancelled_in_log(endless, before + 1)[before:]
    assert len(stopped) == 1 and stopped[0] < 700, stopped  # cut short on the server, not run to max_tokens
    WebDriverWait(browser, 10).until(lambda d: fetch(endless.url + "/v1/stats").json()["state"] == "idle")
    assert browser.find_element(By.ID, "send").get_attribute("disabled") is None
    assert browser.find_element(By.ID, "stop").get_attribute("disabled")
    WebDriverWait(browser, 10).until(lambda d: d.find_element(By.ID, "t-state").text == "idle")  # the panel too


def test_new_chat_cancels_what_runs_and_the_next_question_answers(endless, browser):
    """New chat stops the running answer on the server, frees Send, and the next question is a new chat's."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    open_page(browser, endless)
    before = len(cancelled_in_log(endless, 0, 0))
    start_long_answer(browser, "Write a long story about a shape.", 1)
    browser.find_element(By.ID, "new").click()
    assert browser.find_elements(By.CSS_SELECTOR, ".msg") == []
    WebDriverWait(browser, 10).until(lambda d: d.find_element(By.ID, "send").get_attribute("disabled") is None)
    assert len(cancelled_in_log(endless, before + 1)) == before + 1, endless.text()[-3000:]
    for field, value in (("max-tokens", "8"), ("temperature", "0")):
        browser.find_element(By.ID, field).clear()
        browser.find_element(By.ID, field).send_keys(value)
    ask(browser, "What colour is the shape?", 1)  # the new chat answers, and shows only its own question
    assert len(browser.find_elements(By.CSS_SELECTOR, ".msg.user")) == 1


def test_the_page_is_usable_at_phone_width(server, browser, tmp_path):
    """At 360 px: no horizontal scroll, every input and button inside the screen, Send and Stop visible, and a
    question typed there is answered."""
    from selenium.webdriver.common.by import By

    browser.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                            {"width": 360, "height": 780, "deviceScaleFactor": 1, "mobile": True})
    try:
        open_page(browser, server)
        assert browser.execute_script("return window.innerWidth") == 360
        assert browser.execute_script("return document.scrollingElement.scrollWidth") <= 360
        for el in browser.find_elements(By.CSS_SELECTOR, "textarea, input, button"):
            left, right = browser.execute_script("const r = arguments[0].getBoundingClientRect(); "
                                                 "return [r.left, r.right]", el)
            assert 0 <= left and right <= 360, (el.get_attribute("id"), left, right)
        for b in ("send", "stop"):
            assert browser.find_element(By.ID, b).is_displayed()
        for field, value in (("max-tokens", "8"), ("temperature", "0")):
            browser.find_element(By.ID, field).clear()
            browser.find_element(By.ID, field).send_keys(value)
        ask(browser, "What colour is the shape?", 1)
        assert browser.execute_script("return document.scrollingElement.scrollWidth") <= 360
        screenshot(browser, tmp_path / "chat-page-360.png")
    finally:
        browser.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})


def test_two_memories_on_the_page(conv, browser, tmp_path, monkeypatch):
    """Where the device has memory of its own (planned so on the CPU with STREAMOE_SPLIT_MEMORY=1), /v1/plan and the
    page show the host's accounts and its tier under --host-cap, and /v1/stats the device's memory beside it."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    from streamoe.runtime.serve.openai_api import Limits
    from streamoe.runtime.serve.worker import ServeOptions, serve_accounts

    monkeypatch.setenv("STREAMOE_SPLIT_MEMORY", "1")  # the device's plan as the server makes it: a quarter in slots
    so = ServeOptions("t", limits=Limits(max_body=4 * MiB), max_queue=8, prompt_cache_bytes=8 * MiB)
    p = plan_for(conv, Options(cap_gib=64, ctx=1024, images=True, runtime_bytes=256 * MiB,
                               extra_accounts=serve_accounts(conv, 1024, so)))
    cap = (p.fixed + p.n_layers * p.n_experts // 4 * p.slot_bytes + p.slot_bytes // 2) / 2**30
    s = start_server(conv, tmp_path / "split.log", "--cap", cap, "--host-cap", 2, "--ctx", 1024, "--runtime-mib", 256,
                     "--prompt-cache-mib", 8, env={"STREAMOE_SPLIT_MEMORY": "1", "STREAMOE_HOST_READS": "0"})
    try:
        plan = fetch(s.url + "/v1/plan").json()
        assert plan["host"]["cap"] == 2 << 30 and plan["host"]["accounts"]["runtime"] == 256 * MiB
        assert plan["host"]["tier_slots"] == plan["n_layers"] * plan["n_experts"]  # 2 GiB holds every record
        stats = fetch(s.url + "/v1/stats").json()
        assert stats["host_cap"] == 2 << 30 and 0 < stats["device"] <= stats["cap"]
        browser.get(s.url + "/")
        WebDriverWait(browser, 30).until(lambda d: "host tier" in d.find_element(By.ID, "plan").text)
        text = browser.find_element(By.ID, "plan").text
        assert "host memory · cap 2.00 GiB" in text and "upload ring" in text and "read staging" in text
        answer = fetch(s.url + "/v1/chat/completions", "POST", {"model": "tiny", "max_tokens": 8, "temperature": 0,
                                                                "messages": [{"role": "user", "content": "Hello"}]})
        assert answer.status == 200, answer.text
        metrics = dict(ln.rsplit(" ", 1) for ln in fetch(s.url + "/metrics").text.splitlines() if not ln.startswith("#"))
        assert float(metrics["streamoe_host_memory_cap_bytes"]) == 2 << 30 and float(metrics["streamoe_device_memory_bytes"]) > 0
        assert float(metrics["streamoe_host_tier_hits_total"]) > 0 and float(metrics["streamoe_expert_bytes_read_total"]) == 0
    finally:
        stop_server(s)
    # host reads (the default where --host-cap holds every expert): the pools are a host account, the page says so,
    # and the device's memory in /v1/stats leaves them out
    s = start_server(conv, tmp_path / "reads.log", "--cap", cap, "--host-cap", 2, "--ctx", 1024, "--runtime-mib", 256,
                     "--prompt-cache-mib", 8, env={"STREAMOE_SPLIT_MEMORY": "1"})
    try:
        plan = fetch(s.url + "/v1/plan").json()
        assert plan["host"]["host_reads"] and plan["host"]["tier_slots"] == 0 and plan["hot_slots"] == 0
        assert plan["host"]["accounts"]["expert pools"] == plan["n_layers"] * plan["n_experts"] * plan["slot"]
        stats = fetch(s.url + "/v1/stats").json()
        assert 0 < stats["device"] <= stats["cap"]
        browser.get(s.url + "/")
        WebDriverWait(browser, 30).until(lambda d: "expert pools" in d.find_element(By.ID, "plan").text)
        assert "host tier" not in browser.find_element(By.ID, "plan").text
        assert "read by the GPU over the bus" in browser.find_element(By.ID, "plan-note").text
    finally:
        stop_server(s)


def test_a_failed_question_comes_back_to_the_box(server, browser):
    """A question the server refuses (longer than the planned context) shows its error under the answer's bubble,
    marks the question's bubble, leaves the conversation without that turn and gives the question back to the box
    (it was lost); the next question is answered in a conversation of its own turns."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait

    open_page(browser, server)
    browser.find_element(By.ID, "new").click()
    long = "word " * 6000
    browser.execute_script("document.getElementById('prompt').value = arguments[0]", long)
    browser.find_element(By.ID, "prompt").send_keys(Keys.END, Keys.ENTER)
    WebDriverWait(browser, 60).until(lambda d: d.find_elements(By.CSS_SELECTOR, ".msg.assistant[data-state=error]"))
    assert "planned context" in browser.find_element(By.CSS_SELECTOR, ".msg.assistant .error-line").text
    assert browser.execute_script("return document.getElementById('prompt').value") == long
    assert "failed" in browser.find_elements(By.CSS_SELECTOR, ".msg.user")[-1].get_attribute("class")
    assert browser.execute_script("return history.length") == 0
    browser.execute_script("document.getElementById('prompt').value = ''")
    ask(browser, "Hello", 2)
    assert browser.execute_script("return history.map((m) => m.role)") == ["user", "assistant"]


def test_an_image_that_failed_comes_off_and_a_new_chat_starts_without_it(server, browser, tmp_path):
    """A file that is no image fails its question and comes back attached with it: its control takes it off, and New
    chat clears it too; the next question is answered without it."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait

    open_page(browser, server)
    browser.find_element(By.ID, "new").click()
    bogus = tmp_path / "notimage.png"
    bogus.write_bytes(b"not a picture at all" * 10)
    for take_off in ("detach", "new"):
        browser.find_element(By.ID, "image").send_keys(str(bogus))
        WebDriverWait(browser, 10).until(lambda d: d.find_element(By.ID, "attached").text == "notimage.png")
        assert browser.find_element(By.ID, "detach").is_displayed()
        box = browser.find_element(By.ID, "prompt")
        box.send_keys("What is it?", Keys.ENTER)
        WebDriverWait(browser, 60).until(lambda d: d.find_elements(By.CSS_SELECTOR, ".msg.assistant[data-state=error]"))
        WebDriverWait(browser, 10).until(lambda d: d.find_element(By.ID, "attached").text == "notimage.png")  # back
        browser.find_element(By.ID, take_off).click()
        assert browser.find_element(By.ID, "attached").text == "" and not browser.find_element(By.ID, "detach").is_displayed()
        browser.execute_script("document.getElementById('prompt').value = ''")
    browser.find_element(By.ID, "new").click()
    browser.find_element(By.ID, "max-tokens").clear()
    browser.find_element(By.ID, "max-tokens").send_keys("8")
    ask(browser, "Hello", 1)


def test_a_page_left_mid_answer_stops_it_on_the_server(endless, browser):
    """Leaving the page (another address; it may be kept in the back/forward cache) aborts its answer: the server
    stops generating at its next token."""
    open_page(browser, endless)
    before = len(cancelled_in_log(endless, 0, 0))
    start_long_answer(browser, "Write a long story about a shape.", 1)
    browser.get("about:blank")
    stopped = cancelled_in_log(endless, before + 1)[before:]
    assert len(stopped) == 1 and stopped[0] < 700, stopped
