"""A real browser against `streamlit run`: upload, ask, watch the answer, find the request on the profiling page."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from engine import MetricsStore
from engine.config import SKELETON_DIR
from fixtures import demo
from fixtures.places import chromium_binary

from .conftest import ROOT, free_port

CHROMIUM = chromium_binary()
CHROMIUM_ARGS = demo.CHROMIUM_ARGS


@pytest.fixture
def server(tiny_model, tmp_path):
    yield from run_streamlit(tiny_model, tmp_path, max_new_tokens=24)


@pytest.fixture
def long_answer_server(tiny_model, tmp_path):
    yield from run_streamlit(tiny_model, tmp_path, max_new_tokens=600)


@pytest.fixture
def full_size_server(tmp_path):
    """The bundled skeleton at full size in int8: a real model's load (tens of seconds) and costs, answers capped at
    the synthetic default."""
    yield from run_streamlit(SKELETON_DIR, tmp_path, max_new_tokens=512, dtype="int8")


def run_streamlit(model, tmp_path, max_new_tokens: int, dtype: str | None = None):
    port = free_port()
    env = dict(os.environ, VLSCOPE_MODEL=str(model), VLSCOPE_DB=str(tmp_path / "browser.db"),
               VLSCOPE_MAX_NEW_TOKENS=str(max_new_tokens))
    if dtype:
        env["VLSCOPE_DTYPE"] = dtype
    log = open(tmp_path / "streamlit.log", "w")
    process = subprocess.Popen(
        [sys.executable, "-m", "streamlit", "run", "streamlit_app.py", "--server.port", str(port),
         "--server.address", "127.0.0.1", "--server.headless", "true"],
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            if urllib.request.urlopen(f"{url}/_stcore/health", timeout=2).read() == b"ok":
                break
        except OSError:
            time.sleep(0.5)
    else:
        process.kill()
        pytest.fail("streamlit did not come up: " + (tmp_path / "streamlit.log").read_text()[-2000:])
    yield url, tmp_path / "browser.db"
    process.terminate()
    process.wait(20)
    log.close()


# Elements of metrics whose text runs past their box (Streamlit cuts it with an ellipsis): the metric's text each.
CLIPPED_METRICS = """() => Array.from(document.querySelectorAll('[data-testid="stMetric"]'))
    .filter(metric => [metric, ...metric.querySelectorAll('*')].some(e => e.scrollWidth > e.clientWidth + 1))
    .map(metric => metric.innerText)"""


# The y values of the Profiling page's "answers decoding at once" line, as drawn.
ANSWERS_AT_ONCE = """() => Array.from(document.querySelectorAll('.js-plotly-plot'))
    .flatMap(plot => plot._fullData || []).filter(trace => trace.name === 'answers decoding at once')
    .flatMap(trace => Array.from(trace.y))"""


def ask(page, expect, text: str) -> None:
    """Type into the chat box and send; typed again if a late rerun cleared the box before it was sent."""
    box = page.get_by_test_id("stChatInputTextArea")
    for _ in range(3):
        box.fill(text)
        expect(page.get_by_role("button", name="Send message")).to_be_enabled(timeout=10_000)
        box.press("Enter")
        try:
            expect(page.get_by_test_id("stChatMessage").first).to_be_visible(timeout=20_000)
            return
        except AssertionError:
            continue
    raise AssertionError("the question was never sent: the chat box kept losing its text")


def open_chat(playwright, expect, url: str, height: int):
    """Headless Chromium on the app's chat page, once it has drawn."""
    browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
    page = browser.new_page(viewport={"width": 1400, "height": height})
    page.goto(url, wait_until="domcontentloaded")
    expect(page.get_by_role("heading", name="Chat")).to_be_visible(timeout=120_000)
    return browser, page


def test_upload_ask_stream_and_profile(server, images_dir, tmp_path):
    if not Path(CHROMIUM).exists():
        pytest.fail(f"Chromium not found at {CHROMIUM}: install Debian's chromium (see .ci/run)")
    from playwright.sync_api import expect, sync_playwright

    url, db = server
    with sync_playwright() as playwright:
        browser, page = open_chat(playwright, expect, url, 1000)

        page.locator('[data-testid="stFileUploaderDropzoneInput"]').set_input_files(str(images_dir / "page.png"))
        # The upload's rerun draws the preview and redraws the chat box: text typed before it lands is lost.
        expect(page.get_by_test_id("stImage").first).to_be_visible(timeout=60_000)
        ask(page, expect, "Read the text")

        assistant = page.get_by_test_id("stChatMessage").nth(1)
        expect(assistant.get_by_text("TTFT")).to_be_visible(timeout=120_000)
        answer = assistant.get_by_test_id("stMarkdownContainer").first.inner_text()
        assert answer.strip()
        record = MetricsStore(db).recent(1, include_warmup=False)[0]
        assert record.status == "ok" and record.source == "app" and record.image_sizes == ((384, 191),)
        page.screenshot(path=str(tmp_path / "chat.png"))

        page.get_by_role("link", name="Profiling").click()
        expect(page.get_by_role("heading", name="Profiling")).to_be_visible(timeout=30_000)
        chart = page.locator(".js-plotly-plot").first
        expect(chart).to_be_visible(timeout=30_000)
        expect(chart.get_by_text(record.id[:6])).to_be_visible(timeout=30_000)  # that request's bar
        page.screenshot(path=str(tmp_path / "profiling.png"), full_page=True)
        expect(page.get_by_test_id("stMetric").first).to_be_visible()
        assert page.evaluate(CLIPPED_METRICS) == []  # every value whole, in the page and the sidebar, at 1400 px
        # the bar says what was asked; the answers-at-once chart counts whole answers
        expect(chart.get_by_text("picture").first).to_be_visible()
        page.get_by_text("Answers at once and the tokens they make together").scroll_into_view_if_needed()
        page.wait_for_function(ANSWERS_AT_ONCE.replace("() =>", "() => (") + ").length > 0")
        counts = page.evaluate(ANSWERS_AT_ONCE)
        assert counts and 1 in counts and all(float(count).is_integer() for count in counts), counts
        page.get_by_role("link", name="Benchmark").click()
        expect(page.get_by_role("heading", name="Benchmark", exact=True)).to_be_visible(timeout=30_000)
        # the committed run from a CPU like this one, drawn as plots (per case: TTFT, decode rate, memory)
        expect(page.locator(".js-plotly-plot").first).to_be_visible(timeout=30_000)
        expect(page.get_by_text("decode", exact=False).first).to_be_visible()
        page.screenshot(path=str(tmp_path / "benchmark.png"), full_page=True)
        assert page.evaluate(CLIPPED_METRICS) == []
        # streamlit_app.py serves the API from the same process: it sees the same, already loaded model
        with urllib.request.urlopen(f"{url}/health", timeout=10) as response:
            assert json.loads(response.read())["status"] == "ready"
        if os.environ.get("VLSCOPE_SCREENSHOTS"):
            target = Path(os.environ["VLSCOPE_SCREENSHOTS"])
            target.mkdir(parents=True, exist_ok=True)
            shutil.copy(tmp_path / "chat.png", target / "chat.png")
            shutil.copy(tmp_path / "profiling.png", target / "profiling.png")
            shutil.copy(tmp_path / "benchmark.png", target / "benchmark.png")
        browser.close()


def test_two_sessions_stream_their_answers_at_the_same_time(long_answer_server, tmp_path):
    """Two people ask at once from their own browser sessions: both answers stream, and their records show they
    shared decode steps (batches of two) instead of one waiting for the other's whole answer."""
    if not Path(CHROMIUM).exists():
        pytest.fail(f"Chromium not found at {CHROMIUM}: install Debian's chromium (see .ci/run)")
    from playwright.sync_api import expect, sync_playwright

    url, db = long_answer_server
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        pages = [browser.new_context().new_page() for _ in range(2)]
        for page in pages:
            page.goto(url, wait_until="domcontentloaded")
            expect(page.get_by_role("heading", name="Chat")).to_be_visible(timeout=120_000)
        boxes = [page.get_by_test_id("stChatInputTextArea") for page in pages]
        for box, text in zip(boxes, ("Write a long story about a cat", "Write a long story about a dog")):
            box.fill(text)
        for box in boxes:
            box.press("Enter")
        for page in pages:
            expect(page.get_by_test_id("stChatMessage").nth(1).get_by_text("TTFT")).to_be_visible(timeout=180_000)
        pages[0].screenshot(path=str(tmp_path / "first.png"))
        browser.close()
    records = [r for r in MetricsStore(db).recent(10, include_warmup=False) if r.source == "app"]
    assert len(records) == 2 and all(r.status == "ok" for r in records)
    assert all(2 in r.decode_batch_sizes for r in records), [r.decode_batch_sizes[:5] for r in records]
    first, second = sorted(records, key=lambda r: r.submitted_at)
    assert second.started_at < first.finished_at  # the second began before the first had answered


def test_pdf_pages_picked_asked_and_profiled(server, images_dir, tmp_path):
    """A 3-page PDF attached on the chat page, pages 2-3 picked, an answer streamed with the render stage in its
    stats line, and the request's render_pages stage on the Profiling page."""
    from playwright.sync_api import expect, sync_playwright

    from . import pdfs

    pdf = tmp_path / "scan.pdf"
    pdf.write_bytes(pdfs.from_images([images_dir / "page.png", images_dir / "text.png", images_dir / "coffee.png"]))
    url, db = server
    with sync_playwright() as playwright:
        browser, page = open_chat(playwright, expect, url, 1100)
        page.locator('[data-testid="stFileUploaderDropzoneInput"]').set_input_files(str(pdf))
        expect(page.get_by_text("pages 1-3 of 3")).to_be_visible(timeout=60_000)
        first = page.get_by_label("scan.pdf: first page")
        first.fill("2")
        first.press("Enter")
        expect(page.get_by_text("pages 2-3 of 3")).to_be_visible(timeout=30_000)
        expect(page.get_by_text("p. 2 ·")).to_be_visible()
        ask(page, expect, "What do these pages say?")
        assistant = page.get_by_test_id("stChatMessage").nth(1)
        expect(assistant.get_by_text("2 pages rendered in")).to_be_visible(timeout=120_000)
        page.screenshot(path=str(tmp_path / "chat-pdf.png"), full_page=True)
        if os.environ.get("VLSCOPE_SCREENSHOTS"):
            shutil.copy(tmp_path / "chat-pdf.png", Path(os.environ["VLSCOPE_SCREENSHOTS"]) / "chat-pdf.png")
        record = MetricsStore(db).recent(1, include_warmup=False)[0]
        assert record.status == "ok" and [p["page"] for p in record.document_pages] == [2, 3]

        page.get_by_role("link", name="Profiling").click()
        chart = page.locator(".js-plotly-plot").first
        expect(chart).to_be_visible(timeout=30_000)
        expect(chart.get_by_text("render_pages").first).to_be_visible(timeout=30_000)  # the stage in the legend
        browser.close()


def test_stop_finishes_the_answer_on_the_page_at_once(long_answer_server, tmp_path):
    """Stop pressed while the answer streams: within seconds, with no other input, the answer shows its partial text,
    the "(stopped)" mark and its cost line, and the chat box takes the next question."""
    if not Path(CHROMIUM).exists():
        pytest.fail(f"Chromium not found at {CHROMIUM}: install Debian's chromium (see .ci/run)")
    from playwright.sync_api import expect, sync_playwright

    url, db = long_answer_server
    with sync_playwright() as playwright:
        browser, page = open_chat(playwright, expect, url, 1000)
        ask(page, expect, "Write a long story about a lighthouse")
        assistant = page.get_by_test_id("stChatMessage").nth(1)
        expect(assistant.locator(".st-key-streaming_answer")).to_have_text(re.compile(r"\S"), timeout=120_000)
        page.get_by_test_id("stChatInputStopButton").click()  # the chat box's own Stop
        stopped_at = time.time()
        expect(assistant.get_by_text("(stopped)")).to_be_visible(timeout=10_000)
        expect(assistant.get_by_text("TTFT")).to_be_visible(timeout=10_000)
        waited = time.time() - stopped_at
        page.screenshot(path=str(tmp_path / "stopped.png"))
        expect(page.get_by_test_id("stChatInputTextArea")).to_be_enabled(timeout=10_000)
        record = MetricsStore(db).recent(1, include_warmup=False)[0]
        assert record.status == "cancelled" and 0 < record.output_tokens < 600
        # the next answer streams for seconds and ends by itself: then the box takes a question again
        ask(page, expect, "And another one")
        expect(page.get_by_test_id("stChatMessage").nth(3).get_by_text("TTFT")).to_be_visible(timeout=120_000)
        expect(page.get_by_test_id("stChatInputTextArea")).to_be_enabled(timeout=10_000)
        browser.close()
    assert waited < 10
    assert MetricsStore(db).recent(1, include_warmup=False)[0].output_tokens == 600


def test_a_clip_is_uploaded_sampled_asked_and_profiled(server, tmp_path):
    """A clip made here goes through the chat page: its sampled frames show with their times and its cost before
    the question; the answer carries its cost line; Profiling draws the clip's stages."""
    if not Path(CHROMIUM).exists():
        pytest.fail(f"Chromium not found at {CHROMIUM}: install Debian's chromium (see .ci/run)")
    from playwright.sync_api import expect, sync_playwright

    from samples.clip import make_clip

    clip = make_clip(tmp_path / "forklift.webm", "webm", seconds=4.0, fps=10)
    url, db = server
    with sync_playwright() as playwright:
        browser, page = open_chat(playwright, expect, url, 1000)
        page.locator('[data-testid="stFileUploaderDropzoneInput"]').set_input_files(str(clip))
        expect(page.get_by_text("vision tokens", exact=False).first).to_be_visible(timeout=60_000)
        expect(page.get_by_text("4.0 s at 2 frames a second: 8 frames in 4 pairs", exact=False)).to_be_visible()
        expect(page.get_by_text("0.0 s", exact=True)).to_be_visible()
        ask(page, expect, "When does the square reach the right edge?")
        assistant = page.get_by_test_id("stChatMessage").nth(1)
        expect(assistant.get_by_text("frames decoded in", exact=False)).to_be_visible(timeout=120_000)
        record = MetricsStore(db).recent(1, include_warmup=False)[0]
        assert record.status == "ok" and record.stages["video_probe"] > 0 and record.stages["frame_decode"] > 0
        page.get_by_role("link", name="Profiling").click()
        chart = page.locator(".js-plotly-plot").first
        expect(chart.get_by_text("frame_decode")).to_be_visible(timeout=30_000)  # the stage's legend entry
        page.screenshot(path=str(tmp_path / "clip-profiling.png"), full_page=True)
        browser.close()


def test_a_demo_on_the_full_size_model_never_looks_stuck(full_size_server, tmp_path):
    """As a stakeholder sees it on the full-size model: the first load shows its stage and elapsed time, a PDF
    attached shows the seconds the question will take before it is sent, a preset answer shows progress through
    encode and prefill and stops like any other, keeping its text and cost."""
    if not Path(CHROMIUM).exists():
        pytest.fail(f"Chromium not found at {CHROMIUM}: install Debian's chromium (see .ci/run)")
    from playwright.sync_api import expect, sync_playwright

    url, db = full_size_server
    with sync_playwright() as playwright:
        browser = demo.launch(playwright)
        page = browser.new_page(viewport=demo.VIEWPORT)
        demo.first_load(page, expect, url, tmp_path / "first-load.png")
        estimate = demo.estimate_for_a_pdf(page, expect, demo.scan_pdf(tmp_path), tmp_path / "pdf-estimate.png")
        assert "an answer of 128 tokens (synthetic weights" in estimate
        demo.stop_a_preset_answer(page, expect, tmp_path / "stopped-preset.png")
        browser.close()
    # the real 2B shapes on this CPU: int8 weights, most parameters in one byte, the pages' vision tokens encoded
    record = MetricsStore(db).recent(1, include_warmup=False)[0]
    assert record.status == "cancelled" and record.source == "app"
    assert [page["page"] for page in record.document_pages] == [1, 2]
    assert record.synthetic and record.dtype == "int8" and 2e9 < record.weight_bytes < 4e9
    assert record.vision_tokens == sum(p["vision_tokens"] for p in record.document_pages) > 0
    assert record.stages["vision_encode"] > 0 and 0 < record.output_tokens < 128
