"""The standard request (448x448 photo, "Describe this image.", 64 tokens, greedy) in each precision, one process
per request through `python -m engine ask --json`, interleaved across precisions and dispatch levels so that a
shared host's drift falls on all of them alike.

    python -m bench.standard --model ../shared/qwen3-vl-2b --isa native avx2 --rounds 2 --out standard.md

`--isa avx2` runs a request with PyTorch, oneDNN, fbgemm and this project held to AVX2 (engine/machine.py,
AVX2_DISPATCH): the paths an AVX2-only server takes, measured on a bigger CPU.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from engine.config import DTYPES, PROJECT_DIR
from engine.kernels.memory_read import memory_read_gb_per_s
from engine.machine import AVX2_DISPATCH
from fixtures.places import shared_dir

from .cli import machine_line
from .harness import bench_image, default_images_dir

PROMPT = "Describe this image."
COLUMNS = ("ttft_s", "decode_tokens_per_s", "e2e_s", "output_tokens", "rss_peak_bytes", "decode_weight_bytes")


def one_request(model: str, dtype: str, isa: str, image: Path, tokens: int, db: Path) -> dict:
    env = {**os.environ, **(AVX2_DISPATCH if isa == "avx2" else {})}
    run = subprocess.run(
        [sys.executable, "-m", "engine", "ask", "--model", model, "--image", str(image), "--prompt", PROMPT,
         "--dtype", dtype, "--max-new-tokens", str(tokens), "--db", str(db), "--json"],
        cwd=PROJECT_DIR, env=env, capture_output=True, text=True, timeout=1800)
    if run.returncode != 0:
        return {"dtype": dtype, "isa": isa, "error": run.stderr.strip().splitlines()[-1:] or ["failed"]}
    record = json.loads(run.stdout)
    return {"dtype": dtype, "isa": isa} | {column: record.get(column) for column in COLUMNS} | {
        "compute_dtype": record.get("compute_dtype")}


def drift(model: str, isa: str, tokens: int, size: int) -> dict:
    """Each compact precision's drift against float32 as the bench measures it (teacher-forced on float32's answer:
    the quick bench's is a 256x256 photo and 8 tokens, the full bench's 448x448 and 32), in a child held to `isa`."""
    env = {**os.environ, **(AVX2_DISPATCH if isa == "avx2" else {})}
    code = ("import json, sys; from bench.harness import default_images_dir, measure_drift; from speed.sweep import bench_image; "
            "from PIL import Image; size = int(sys.argv[3]); image = bench_image('448x448', default_images_dir())"
            ".resize((size, size), Image.BICUBIC); print(json.dumps(measure_drift(sys.argv[1], image, "
            "['bfloat16', 'int8', 'int4'], int(sys.argv[2]), 2, lambda f, m: None)))")
    run = subprocess.run([sys.executable, "-c", code, model, str(tokens), str(size)], cwd=PROJECT_DIR, env=env,
                         capture_output=True, text=True, timeout=3600)
    if run.returncode != 0:
        return {"error": run.stderr.strip().splitlines()[-1:]}
    return json.loads(run.stdout.strip().splitlines()[-1])


def table(rows: list[dict], ceiling: float | None = None) -> str:
    """The rows as markdown; decode's weight reads as a share of `ceiling` (GB/s) where given."""
    lines = ["| precision | dispatch | computes in | TTFT s | decode tok/s | % of read ceiling | end to end s | tokens | "
             "peak RSS GB |", "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['dtype']} | {row['isa']} | error: {row['error'][0]} | | | | | | |")
            continue
        read = row["decode_tokens_per_s"] * (row.get("decode_weight_bytes") or 0) / 1e9
        share = f"{100 * read / ceiling:.0f}" if read and ceiling else "–"
        lines.append(f"| {row['dtype']} | {row['isa']} | {row['compute_dtype']} | {row['ttft_s']:.2f} | "
                     f"{row['decode_tokens_per_s']:.2f} | {share} | {row['e2e_s']:.2f} | {row['output_tokens']} | "
                     f"{row['rss_peak_bytes'] / 1e9:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.standard", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(shared_dir() / "qwen3-vl-2b"))
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES))
    parser.add_argument("--isa", nargs="+", default=["native"], choices=["native", "avx2"])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--out", help="also write the markdown table here")
    parser.add_argument("--drift", action="store_true", help="also measure each dispatch level's drift against float32")
    parser.add_argument("--drift-tokens", type=int, default=8, help="answer tokens the drift is read over (full bench: 32)")
    parser.add_argument("--drift-size", type=int, default=256, help="the drift photo's side (full bench: 448)")
    args = parser.parse_args(argv)
    rows, ceilings = [], [memory_read_gb_per_s()]  # read between requests, while this process is alone
    with tempfile.TemporaryDirectory() as work:
        image = Path(work) / "standard-448.png"
        bench_image("448x448", default_images_dir()).save(image)
        for round_ in range(args.rounds):
            order = [(d, i) for d in args.dtypes for i in args.isa]
            for dtype, isa in (order if round_ % 2 == 0 else order[::-1]):  # A B then B A
                row = one_request(args.model, dtype, isa, image, args.max_new_tokens, Path(work) / "m.db")
                rows.append(row | {"round": round_ + 1})
                print(json.dumps(row), file=sys.stderr, flush=True)
                ceilings.append(memory_read_gb_per_s())
    rows.sort(key=lambda row: (args.dtypes.index(row["dtype"]), args.isa.index(row["isa"]), row["round"]))
    ceiling = max(ceilings)
    text = (f"{machine_line()}; {args.max_new_tokens} tokens, one process per request; read ceiling {ceiling:.1f} GB/s "
            f"(best of {len(ceilings)} reads between requests)\n\n{table(rows, ceiling)}\n")
    if args.drift:
        lines = ["", f"Drift: {args.drift_size}x{args.drift_size} photo, {args.drift_tokens} answer tokens, teacher-forced "
                 "on float32's answer, over the prompt's text and the answer", "",
                 "| dispatch | precision | top-1 agreement with float32 | largest logit difference |",
                 "|---|---|---|---|"]
        for isa in args.isa:
            measured = drift(args.model, isa, args.drift_tokens, args.drift_size)
            for dtype, figures in measured.items():
                if dtype == "error":
                    lines.append(f"| {isa} | error: {figures} | | |")
                    continue
                lines.append(f"| {isa} | {dtype} | {figures['top1_agreement']:.1%} | "
                             f"{figures['max_abs_logit_error']:.3f} |")
        text += "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0 if all("error" not in row for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
