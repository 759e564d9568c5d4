"""`python -m bench.screenshots`: the docs' pictures, made anew from the app as a user sees it on the default
settings: `streamlit run` on the full-size model (the bundled skeleton unless --model says otherwise), its first
load, a scan uploaded and read on the Chat page, the Profiling and Benchmark pages, then the demo (a PDF's estimate
before sending, a preset answer stopped, the sweep beside the record), in headless Chromium at 1400x1000.

    python -m bench.screenshots                       # docs/first-load.png, docs/chat.png, ... into docs/
    python -m bench.screenshots --dtype int8 --out /tmp/shots
"""
from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from engine.config import PROJECT_DIR, SKELETON_DIR
from fixtures import demo


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _up(url: str, seconds: float) -> None:
    """Waits until the server answers at all, so the first page drawn is the model's load."""
    deadline = time.time() + seconds
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/_stcore/health", timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the app did not start within {seconds:.0f} s")


def take(model: str, dtype: str, out: Path, max_new_tokens: int, report=print) -> list[Path]:
    from playwright.sync_api import expect, sync_playwright

    out.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    shots = [out / name for name in ("first-load.png", "chat.png", "profiling.png", "benchmark.png",
                                     "pdf-estimate.png", "stopped-preset.png", "benchmark-sweep.png")]
    with tempfile.TemporaryDirectory() as folder:
        env = dict(os.environ, VLSCOPE_MODEL=model, VLSCOPE_DTYPE=dtype, VLSCOPE_DB=str(Path(folder) / "shots.db"),
                   VLSCOPE_MAX_NEW_TOKENS=str(max_new_tokens))
        server = subprocess.Popen([sys.executable, "-m", "streamlit", "run", "streamlit_app.py", "--server.port",
                                   str(port), "--server.address", "127.0.0.1", "--server.headless", "true"],
                                  cwd=PROJECT_DIR, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            report(f"loading {model} ({dtype}) at {url}")
            _up(url, 120)
            with sync_playwright() as playwright:
                browser = demo.launch(playwright)
                page = browser.new_page(viewport=demo.VIEWPORT)
                demo.first_load(page, expect, url, shots[0])
                page.locator('[data-testid="stFileUploaderDropzoneInput"]').set_input_files(
                    str(PROJECT_DIR / "samples" / "page.png"))
                expect(page.get_by_test_id("stImage").first).to_be_visible(timeout=60_000)
                box = page.get_by_test_id("stChatInputTextArea")
                box.fill("Read the text")
                expect(page.get_by_role("button", name="Send message")).to_be_enabled(timeout=10_000)
                box.press("Enter")
                report("asked; waiting for the answer and its cost line")
                answer = page.get_by_test_id("stChatMessage").nth(1)
                expect(answer.get_by_text("TTFT")).to_be_visible(timeout=600_000)
                page.screenshot(path=str(shots[1]))
                page.get_by_role("link", name="Profiling").click()
                expect(page.locator(".js-plotly-plot").first).to_be_visible(timeout=60_000)
                page.screenshot(path=str(shots[2]))
                page.get_by_role("link", name="Benchmark").click()
                expect(page.get_by_role("heading", name="Benchmark", exact=True)).to_be_visible(timeout=60_000)
                expect(page.locator(".js-plotly-plot").first).to_be_visible(timeout=60_000)
                page.screenshot(path=str(shots[3]))
                report("the demo: a PDF's estimate, a preset answer stopped, the sweep beside the record")
                page = browser.new_context(viewport=demo.VIEWPORT).new_page()  # a new session: nothing attached
                page.goto(url, wait_until="domcontentloaded")
                expect(page.get_by_role("heading", name="Chat")).to_be_visible(timeout=120_000)
                demo.estimate_for_a_pdf(page, expect, demo.scan_pdf(Path(folder)), shots[4])
                demo.stop_a_preset_answer(page, expect, shots[5])
                demo.sweep_beside_the_record(page, expect, shots[6])
                browser.close()
        finally:
            server.terminate()
            server.wait(30)
    return shots


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.screenshots", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(SKELETON_DIR.relative_to(PROJECT_DIR)),
                        help="model folder, from the checkout (default: the bundled skeleton)")
    parser.add_argument("--dtype", default="float32", help="precision (default float32, the app's default)")
    parser.add_argument("--out", default=str(PROJECT_DIR / "docs"), help="where the PNGs go")
    parser.add_argument("--max-new-tokens", type=int, default=48, help="the answer's length on the Chat page")
    args = parser.parse_args(argv)
    for path in take(args.model, args.dtype, Path(args.out), args.max_new_tokens,
                     report=lambda message: print(message, file=sys.stderr, flush=True)):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
