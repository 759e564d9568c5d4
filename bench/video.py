"""`python -m bench.video`: the standard clip (10 s made here at test time, 448x448, 2 frames a second, "What
happens in this clip?", 32 new tokens, greedy) in each precision, one process per request through
`python -m engine ask --video --json`: the clip's probe, frame decode, vision encode and prefill, its first token,
its vision tokens and peak RSS.

    python -m bench.video --dtypes int8 float32 --out video.md
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from engine.config import DTYPES, PROJECT_DIR, SKELETON_DIR
from samples.clip import make_clip

from .cli import machine_line

PROMPT = "What happens in this clip?"
STAGES = ("video_probe", "frame_decode", "vision_encode", "prefill")


def one_request(model: str, dtype: str, clip: Path, fps: float, tokens: int, db: Path) -> dict:
    run = subprocess.run(
        [sys.executable, "-m", "engine", "ask", "--model", model, "--video", str(clip), "--fps", str(fps),
         "--prompt", PROMPT, "--dtype", dtype, "--max-new-tokens", str(tokens), "--db", str(db), "--json"],
        cwd=PROJECT_DIR, capture_output=True, text=True, timeout=1800)
    if run.returncode != 0:
        return {"dtype": dtype, "error": (run.stderr.strip().splitlines() or ["failed"])[-1]}
    record = json.loads(run.stdout)
    return {"dtype": dtype, "compute_dtype": record["compute_dtype"], "ttft_s": record["ttft_s"],
            "e2e_s": record["e2e_s"], "vision_tokens": record["vision_tokens"],
            "prompt_tokens": record["prompt_tokens"], "rss_peak_bytes": record["rss_peak_bytes"],
            "stages": {stage: record["stages"].get(stage) for stage in STAGES}}


def table(rows: list[dict]) -> str:
    lines = ["| precision | computes in | probe s | frame decode s | vision encode s | prefill s | TTFT s | "
             "vision tokens | prompt tokens | end to end s | peak RSS GB |", "|---" * 11 + "|"]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['dtype']} | failed: {row['error'][:120]} |")
            continue
        stages = [f"{row['stages'][stage]:.2f}" if row['stages'][stage] is not None else "–" for stage in STAGES]
        lines.append(f"| {row['dtype']} | {row['compute_dtype']} | {' | '.join(stages)} | {row['ttft_s']:.2f} | "
                     f"{row['vision_tokens']} | {row['prompt_tokens']} | {row['e2e_s']:.2f} | "
                     f"{row['rss_peak_bytes'] / 1e9:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.video", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(SKELETON_DIR))
    parser.add_argument("--dtypes", nargs="+", choices=DTYPES, default=["int8", "float32"])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--size", type=int, default=448)
    parser.add_argument("--fps", type=float, default=2.0)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--out", help="write the table here too (and its JSON beside it)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        clip = make_clip(Path(folder) / "standard.mp4", seconds=args.seconds, fps=24, size=(args.size, args.size))
        rows = [one_request(args.model, dtype, clip, args.fps, args.tokens, Path(folder) / "video.db")
                for dtype in args.dtypes]
    text = (f"{machine_line()}; a {args.seconds:g} s {args.size}x{args.size} H.264 clip at {args.fps:g} frames a "
            f"second, {args.tokens} new tokens, one process per request\n\n{table(rows)}\n")
    print(text)
    if args.out:
        Path(args.out).write_text(text)
        Path(args.out).with_suffix(".json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
