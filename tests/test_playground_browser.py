"""The playground in a real browser (slow tier): headless Chromium from Debian's packages
(``make browser``) loads the page, sends a message, waits until both panes finished and takes a
screenshot. ``DLLM_PLAYGROUND_SCREENSHOT=docs/img/playground.png`` also writes it there (the
image docs/playground.md shows)."""
import os
import shutil
import socket
from pathlib import Path

import pytest

from dllm_engine import LLM
from dllm_engine.spec import parse_spec

pytestmark = pytest.mark.slow
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
CHECKPOINTS = Path(__file__).resolve().parent.parent / "checkpoints"
MESSAGE = "spell : 5 6 9 6 4 9 2 7"
WAIT_MS = 180_000  # every wait in the page is bounded


def chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        pytest.skip("Chromium is not installed: `make browser` installs Debian's package (apt-get install chromium)")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_page_decodes_a_message_in_both_panes(tmp_path):
    pytest.importorskip("gradio", reason="the ui extra: pip install 'dllm-engine[ui]'")
    sync_api = pytest.importorskip("playwright.sync_api", reason="the test extra installs playwright")
    executable = chromium()
    from dllm_engine.playground.app import build_app, launch
    llm = LLM(CHECKPOINTS / "tiny-llada")
    demo = build_app(llm)
    url = launch(demo, port=free_port(), block=False)
    shot = tmp_path / "playground.png"
    try:
        with sync_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=executable, headless=True,
                                        args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"])
            try:
                texts = drive(browser, url, shot)
            finally:
                browser.close()
    finally:
        demo.close()
    specs = ("dual-cache", "dual-cache+adaptive-length+jump-share")
    for spec, text in zip(specs, texts):
        assert text == llm.chat([{"role": "user", "content": MESSAGE}], parse_spec(spec))[0].text
    check_image(shot)
    if os.environ.get("DLLM_PLAYGROUND_SCREENSHOT"):
        shutil.copyfile(shot, os.environ["DLLM_PLAYGROUND_SCREENSHOT"])


def drive(browser, url: str, shot: Path) -> list[str]:
    """Load the page, send ``MESSAGE``, wait for both panes and the summary, screenshot; returns
    the two answers as the page shows them."""
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.set_default_timeout(WAIT_MS)
    page.goto(url, wait_until="domcontentloaded")
    page.locator("#message textarea").fill(MESSAGE)
    page.locator("#send").click()
    page.wait_for_function("document.querySelectorAll('.dllm-pane[data-done=\"true\"]').length == 2",
                           timeout=WAIT_MS)
    page.wait_for_function("document.querySelector('#summary').innerText.includes('tok/s of pane A')", timeout=WAIT_MS)
    page.wait_for_function("document.querySelector('#text-b textarea').value.length > 0", timeout=WAIT_MS)
    assert page.locator(".dllm-error").count() == 0
    page.screenshot(path=str(shot), full_page=True)
    return [page.locator(f"#text-{x} textarea").input_value() for x in ("a", "b")]


def check_image(path: Path) -> None:
    """A real page: large, and not one colour (the canvases are coloured by step)."""
    from PIL import Image
    with Image.open(path) as img:
        assert img.width >= 1000 and img.height >= 600
        colours = img.convert("RGB").resize((200, 150)).getcolors(maxcolors=200 * 150)
        assert colours is not None and len(colours) > 20
