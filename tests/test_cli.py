"""`python -m engine ask` as users and the acceptance checks call it."""
from __future__ import annotations

import json
import subprocess
import sys

from .conftest import ROOT

REQUIRED = ("ttft_s", "decode_tokens_per_s", "e2e_s", "vision_tokens", "prompt_tokens", "output_tokens", "stages",
            "rss_before_bytes", "rss_peak_bytes", "rss_after_bytes", "synthetic", "status")


def ask(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "engine", "ask", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def test_ask_json_on_tiny_model(tiny_model, images_dir, tmp_path):
    run = ask("--model", str(tiny_model), "--image", str(images_dir / "page.png"), "--prompt", "Read the text",
              "--max-new-tokens", "8", "--json", "--db", str(tmp_path / "m.db"))
    assert run.returncode == 0, run.stderr
    record = json.loads(run.stdout)
    assert all(key in record for key in REQUIRED)
    assert set(record["stages"]) >= {"load_images", "preprocess", "vision_encode", "prefill", "decode", "detokenize"}
    assert record["status"] == "ok" and record["output_tokens"] == 8 and record["synthetic"] is False


def test_ask_table_and_bad_input(tiny_model, tmp_path):
    run = ask("--model", str(tiny_model), "--prompt", "Hi", "--max-new-tokens", "3", "--db", str(tmp_path / "m.db"))
    assert run.returncode == 0 and "prefill" in run.stdout and "TTFT" in run.stdout
    bad = tmp_path / "x.png"
    bad.write_bytes(b"GIF89a broken")
    run = ask("--model", str(tiny_model), "--image", str(bad), "--prompt", "Hi", "--db", str(tmp_path / "m.db"))
    assert run.returncode == 2
    assert run.stderr.strip().splitlines()[-1].startswith("error: x.png:")
    run = ask("--model", str(tmp_path / "missing"), "--prompt", "Hi", "--db", str(tmp_path / "m.db"))
    assert run.returncode == 2 and "does not exist" in run.stderr
    assert "Traceback" not in run.stderr


def test_engine_bench_hands_over_to_the_bench_package():
    """The issue's `python -m engine bench ...` runs the sweep in bench/ with the same options."""
    run = subprocess.run([sys.executable, "-m", "engine", "bench", "--help"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0 and "usage: python -m bench" in run.stdout and "--against" in run.stdout
