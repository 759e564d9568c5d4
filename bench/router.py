"""The cluster's routing against another checkout's (an earlier router), interleaved, in one run:

    python -m bench.router --before /tmp/before --model models/qwen3-vl-2b-skeleton --dtype int8 --rounds 2

Each round starts `python -m scale` (two replicas of one thread) of this checkout and of --before, in an order
reversed every round, and sends each two bursts: `--people` people at once with a picture each, and one session
sending `--people` requests at once about one picture (one `x-session-id`). Reports wall time, TTFT p50 and max,
and the per-round ratios of this checkout's to the other's.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from engine.config import DTYPES, PROJECT_DIR

from .cli import machine_line, write_results
from .harness import default_images_dir
from .load import burst, served_model
from .scale import start_cluster, stop_cluster

CASES = ("people", "one session")


def measure(root: Path, args, folder: Path, tag: str) -> dict:
    env = {"VLSCOPE_MODEL": args.model, "VLSCOPE_DTYPE": args.dtype, "VLSCOPE_API_ALLOW_IGNORE_EOS": "on",
           "VLSCOPE_DB": str(folder / f"{tag}.db")}
    cluster, url = start_cluster(2, 1, env, folder / f"{tag}.log", root=root)
    try:
        model = served_model(f"{url}/v1")
        figures = {}
        for case in CASES:
            result = burst(f"{url}/v1", model, args.people, args.max_tokens, Path(args.images),
                           session=f"bench-{tag}" if case == "one session" else None)
            figures[case] = {"wall_s": result.wall_s, "ttft_p50_s": result.ttft_p50_s,
                             "ttft_max_s": result.ttft_max_s, "errors": result.errors}
            print(f"  {tag:6s} {case:12s} wall {result.wall_s:6.2f} s  TTFT p50 {result.ttft_p50_s:6.2f} s  "
                  f"max {result.ttft_max_s:6.2f} s  errors {result.errors}", flush=True)
        return figures
    finally:
        stop_cluster(cluster)


def markdown(rounds: list[dict]) -> str:
    lines = ["| case | figure | this checkout | before | ratio per round | median ratio |", "|---|---|---|---|---|---|"]
    for case in CASES:
        for figure in ("wall_s", "ttft_p50_s", "ttft_max_s"):
            now = [r["now"][case][figure] for r in rounds]
            before = [r["before"][case][figure] for r in rounds]
            ratios = [a / b for a, b in zip(now, before)]
            lines.append(f"| {case} | {figure} | {statistics.median(now):.2f} | {statistics.median(before):.2f} | "
                         f"{', '.join(f'{x:.2f}' for x in ratios)} | **{statistics.median(ratios):.2f}x** |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.router", description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", required=True, help="the other checkout (git worktree add /tmp/before <rev>)")
    parser.add_argument("--model", default=str(PROJECT_DIR / "models" / "qwen3-vl-2b-skeleton"))
    parser.add_argument("--dtype", default="int8", choices=DTYPES)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--people", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--images", default=str(default_images_dir()))
    parser.add_argument("--out", help="write the results here as JSON, and a markdown table beside it")
    args = parser.parse_args(argv)
    print(machine_line(), flush=True)
    rounds = []
    with tempfile.TemporaryDirectory() as folder:
        for index in range(args.rounds):
            order = [("now", PROJECT_DIR), ("before", Path(args.before))]
            figures = {tag: measure(root, args, Path(folder), f"{tag}{index}")
                       for tag, root in (order if index % 2 == 0 else order[::-1])}
            rounds.append(figures)
    table = markdown(rounds)
    print(table)
    if args.out:
        write_results(args.out, {"machine": machine_line(), "args": vars(args), "rounds": rounds}, table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
