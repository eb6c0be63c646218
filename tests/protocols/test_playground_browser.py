"""The browser pages in a real browser: headless Chromium driven by selenium opens ``GET /``,
chats (streamed text, a reasoning block, a tool call), works behind ``--api-key`` with the key
typed into the page, and renders Swagger UI at ``/docs`` without a request leaving the server.

The server is ``llmserve serve`` on the echo backend with a chat template that renders the last
message alone, so the "model" answers exactly what the test types: reasoning and tool-call
markup included, which the server's own parsers then split out. Screenshots are kept in
pytest's temporary folder (the path is printed).
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from conftest import ECHO_PLUGIN

webdriver = pytest.importorskip("selenium.webdriver")
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support import expected_conditions as EC
from selenium.webdriver.support.ui import Select, WebDriverWait

CHROMIUM, DRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--window-size=1280,860"]
LAST_MESSAGE = "{{ messages[-1].content }}"
SERVE = ("--plugin", ECHO_PLUGIN, "--backend", "echo", "--chat-template", LAST_MESSAGE,
         "--reasoning-parser", "deepseek_r1", "--tool-call-parser", "hermes", "--enable-auto-tool-choice",
         "--log-level", "warning")
SLOW_STEPS = {"LLMSERVE_ECHO_STEP_DELAY": "0.02"}  # one token per 20 ms: the stream is seen growing
KEY = "playground-key-7c1f"

pytestmark = pytest.mark.skipif(not (CHROMIUM.exists() and DRIVER.exists()),
                                reason="needs Debian's chromium and chromium-driver (make test installs them)")


@pytest.fixture
def browser(tmp_path):
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in [*FLAGS, f"--user-data-dir={tmp_path / 'profile'}"]:
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"performance": "ALL", "browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=str(DRIVER)))
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(tmp_path / "profile", ignore_errors=True)


def requested_urls(driver) -> list[str]:
    """Every network URL requested since the last call (Chromium's DevTools network log). The
    browser's own chrome:// pages and data: URLs are not network requests, and neither are the
    requests the browser blocked itself (the pages' Content-Security-Policy) before sending."""
    sent: dict[str, str] = {}
    blocked: set[str] = set()
    for entry in driver.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        params = message.get("params", {})
        if message.get("method") == "Network.requestWillBeSent":
            url = params["request"]["url"]
            if url.split(":", 1)[0] in ("http", "https", "ws", "wss"):
                sent[params["requestId"]] = url
        elif message.get("method") == "Network.loadingFailed" and params.get("blockedReason"):
            blocked.add(params["requestId"])
    return [url for request_id, url in sent.items() if request_id not in blocked]


def screenshot(driver, tmp_path: Path, name: str) -> Path:
    path = tmp_path / f"{name}.png"
    driver.save_screenshot(str(path))
    print(f"screenshot: {path}")
    return path


def wait(driver, seconds: float = 30) -> WebDriverWait:
    return WebDriverWait(driver, seconds, poll_frequency=0.02)


def send(driver, text: str) -> None:
    box = driver.find_element(By.ID, "prompt")
    box.send_keys(text)
    box.send_keys(Keys.ENTER)


def assistant_replies(driver) -> list:
    return driver.find_elements(By.CSS_SELECTOR, ".msg.assistant")


def finished_reply(driver, count: int, seconds: float = 60):
    """The ``count``-th assistant reply once its stats line (written when the stream ends) is there."""
    wait(driver, seconds).until(lambda d: len(d.find_elements(By.CSS_SELECTOR, ".msg.assistant .stats")) >= count)
    return assistant_replies(driver)[count - 1]


def test_chat_streams_and_shows_reasoning_and_tool_calls(server_process, browser, tmp_path):
    server = server_process(*SERVE, env=SLOW_STEPS)
    browser.get(server.url + "/")
    assert browser.title == "llmserve playground"
    wait(browser).until(EC.text_to_be_present_in_element((By.ID, "model"), "echo"))
    wait(browser).until(EC.text_to_be_present_in_element((By.ID, "metrics"), "KV cache"))
    assert not browser.find_element(By.ID, "attach").is_displayed()  # a text-only model: no image button

    # Plain text: seen growing while it streams, then whole, with its timings.
    # (deepseek_r1 reads output without </think> as all reasoning: the echoed reply closes its thinking.)
    thought = "<think>A plain answer will do.</think>"
    text = "Streaming shows each token as soon as the server has it, long before the reply is done."
    send(browser, thought + text)
    lengths = set()
    deadline = time.time() + 60
    while time.time() < deadline:
        replies = browser.find_elements(By.CSS_SELECTOR, ".msg.assistant .content")
        if replies:
            lengths.add(len(replies[0].text))
        if browser.find_elements(By.CSS_SELECTOR, ".msg.assistant .stats"):
            break
        time.sleep(0.02)
    reply = finished_reply(browser, 1)
    assert reply.find_element(By.CSS_SELECTOR, ".content").text == text
    assert any(0 < n < len(text) for n in lengths), sorted(lengths)  # partial text was on screen
    stats = reply.find_element(By.CSS_SELECTOR, ".stats").text
    echoed = len((thought + text).encode()) + 1  # the echoed bytes and EOS
    assert "TTFT" in stats and "tokens/s" in stats and f" {echoed} tokens" in stats, stats

    # Tools offered from the page; the reply's reasoning and call come out of the parsers.
    browser.find_element(By.CSS_SELECTOR, "#tools-box summary").click()
    browser.find_element(By.ID, "tools-example").click()
    assert "get_weather" in browser.find_element(By.ID, "tools").get_attribute("value")
    assert browser.find_element(By.CSS_SELECTOR, "#tool-choice option[value='fn:get_weather']")
    browser.find_element(By.ID, "system").send_keys("You answer with tools.")
    send(browser, '<think>The user wants the weather, so I call the tool.</think>Checking. '
                  '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>')
    reply = finished_reply(browser, 2)
    assert reply.find_element(By.CSS_SELECTOR, ".reasoning-text").text == \
        "The user wants the weather, so I call the tool."
    assert reply.find_element(By.CSS_SELECTOR, ".content").text.strip() == "Checking."
    assert reply.find_element(By.CSS_SELECTOR, ".tool-call .tool-name").text == "get_weather"
    assert json.loads(reply.find_element(By.CSS_SELECTOR, ".tool-call .tool-args").text) == {"city": "Paris"}
    assert "finish: tool_calls" in reply.find_element(By.CSS_SELECTOR, ".stats").text
    assert not browser.find_element(By.ID, "error").is_displayed()
    shot = screenshot(browser, tmp_path, "playground")
    assert shot.stat().st_size > 10_000

    # Everything the page loaded came from the server itself.
    urls = requested_urls(browser)
    assert any(u.endswith("/v1/chat/completions") for u in urls)
    assert urls and all(u.startswith(server.url + "/") for u in urls), urls


def test_page_loads_without_a_key_and_chats_with_the_typed_key(server_process, browser, tmp_path):
    server = server_process(*SERVE, "--api-key", KEY)
    browser.get(server.url + "/")  # the page and its assets need no key
    wait(browser).until(EC.text_to_be_present_in_element((By.ID, "model"), "API key needed"))
    send(browser, "hello")
    wait(browser).until(EC.visibility_of_element_located((By.ID, "error")))
    assert "API key" in browser.find_element(By.ID, "error").text
    # The refused turn left the conversation; its text is back in the box to send again.
    assert browser.find_elements(By.CSS_SELECTOR, ".msg") == []
    assert browser.find_element(By.ID, "prompt").get_attribute("value") == "hello"
    browser.find_element(By.ID, "prompt").clear()

    key = browser.find_element(By.ID, "api-key")
    key.send_keys(KEY)
    key.send_keys(Keys.TAB)  # "change": the page saves it and reloads the model and metrics
    wait(browser).until(EC.text_to_be_present_in_element((By.ID, "model"), "echo"))
    wait(browser).until(EC.text_to_be_present_in_element((By.ID, "metrics"), "KV cache"))
    send(browser, "<think>Greet back.</think>hello with a key")
    reply = finished_reply(browser, 1)
    assert reply.find_element(By.CSS_SELECTOR, ".content").text == "hello with a key"
    assert not browser.find_element(By.ID, "error").is_displayed()
    screenshot(browser, tmp_path, "playground-keyed")

    # The API docs of the same browser send the saved key: the document loads and lists routes.
    browser.get(server.url + "/docs")
    wait(browser, 60).until(EC.presence_of_element_located((By.CSS_SELECTOR, ".swagger-ui .opblock")))


def test_swagger_ui_renders_from_local_files(server_process, browser, tmp_path):
    server = server_process(*SERVE)
    browser.get(server.url + "/docs")
    wait(browser, 60).until(EC.presence_of_element_located((By.CSS_SELECTOR, ".swagger-ui .information-container")))
    wait(browser, 60).until(EC.presence_of_element_located((By.CSS_SELECTOR, ".swagger-ui .opblock")))
    assert "/v1/chat/completions" in browser.find_element(By.CSS_SELECTOR, ".swagger-ui").text
    screenshot(browser, tmp_path, "swagger")
    urls = requested_urls(browser)
    assert any(u.endswith("/assets/swagger-ui-bundle.js") for u in urls) and any(
        u.endswith("/openapi.json") for u in urls)
    assert urls and all(u.startswith(server.url + "/") for u in urls), urls

    browser.get(server.url + "/redoc")
    wait(browser, 60).until(EC.presence_of_element_located((By.CSS_SELECTOR, "#redoc .api-content")))
    urls = requested_urls(browser)
    assert urls and all(u.startswith(server.url + "/") for u in urls), urls


@pytest.mark.slow
def test_real_model_forced_tool_call_and_json_schema_mode(smollm_server, browser, tmp_path):
    """The embedded SmolLM2: the page's named tool_choice and JSON schema mode constrain what it says."""
    browser.get(smollm_server.url + "/")
    wait(browser).until(EC.text_to_be_present_in_element((By.ID, "model"), "SmolLM2"))
    tokens = browser.find_element(By.ID, "max-tokens")
    tokens.clear()
    tokens.send_keys("80")
    # Greedy: the page's default temperature samples, and a sampled string field may run past 80 tokens.
    temperature = browser.find_element(By.ID, "temperature")
    temperature.clear()
    temperature.send_keys("0")
    browser.find_element(By.CSS_SELECTOR, "#tools-box summary").click()
    browser.find_element(By.ID, "tools-example").click()
    Select(browser.find_element(By.ID, "tool-choice")).select_by_value("fn:get_weather")
    send(browser, "What is the weather like in Paris today?")
    reply = finished_reply(browser, 1, 240)
    assert reply.find_element(By.CSS_SELECTOR, ".tool-call .tool-name").text == "get_weather"
    arguments = json.loads(reply.find_element(By.CSS_SELECTOR, ".tool-call .tool-args").text)
    assert set(arguments) == {"city"} and isinstance(arguments["city"], str)

    browser.find_element(By.ID, "tools").clear()  # no tools: a plain request with a schema
    browser.find_element(By.CSS_SELECTOR, "#schema-box summary").click()
    browser.find_element(By.ID, "schema-on").click()
    send(browser, "Name a city and the country it is in.")
    reply = finished_reply(browser, 2, 240)
    answer = json.loads(reply.find_element(By.CSS_SELECTOR, ".content").text)
    assert set(answer) == {"city", "country"} and all(isinstance(v, str) for v in answer.values())
    assert "tokens/s" in reply.find_element(By.CSS_SELECTOR, ".stats").text
    screenshot(browser, tmp_path, "playground-smollm2")


def test_an_image_attached_in_the_page_reaches_a_vision_model(server_process, browser, tmp_path, tmp_path_factory):
    """A tiny generated SmolVLM-shaped model (tests/vision_model.py): the page offers its image
    button, the picture goes as an image_url part, and the greedy answer is transformers' own."""
    import vision_model

    path = vision_model.model_dir(tmp_path_factory)
    question, picture = "What is in the picture?", tmp_path / "picture.png"
    picture.write_bytes(vision_model.png(1))
    want = vision_model.reference_generate(path, f"<|im_start|>User:<image>{question}<end_of_utterance>\nAssistant:",
                                           [vision_model.picture(1)], 6)
    server = server_process(path, "--dtype", "float32", "--served-model-name", "tiny-vlm", "--log-level", "warning")
    browser.get(server.url + "/")
    wait(browser).until(EC.text_to_be_present_in_element((By.ID, "model"), "tiny-vlm"))
    wait(browser).until(lambda d: d.find_element(By.ID, "attach").is_displayed())
    for field, value in (("temperature", "0"), ("max-tokens", "6")):
        box = browser.find_element(By.ID, field)
        box.clear()
        box.send_keys(value)
    chooser = browser.find_element(By.ID, "image-file")
    browser.execute_script("arguments[0].hidden = false;", chooser)  # what the Image button opens
    chooser.send_keys(str(picture))
    wait(browser).until(lambda d: d.find_elements(By.CSS_SELECTOR, "#attachments img.thumb"))
    send(browser, question)
    reply = finished_reply(browser, 1)
    assert browser.find_elements(By.CSS_SELECTOR, ".msg.user img.thumb")  # the picture shows in the question
    assert not browser.find_elements(By.CSS_SELECTOR, "#attachments img.thumb")  # and left the composer
    from transformers import AutoTokenizer

    assert reply.find_element(By.CSS_SELECTOR, ".content").text.strip() == AutoTokenizer.from_pretrained(
        path).decode(want, skip_special_tokens=True).strip()
    assert not browser.find_element(By.ID, "error").is_displayed()

