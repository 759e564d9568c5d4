"""The cluster's routing against another checkout's (an earlier router), or at several balance thresholds,
interleaved, in one run:

    python -m bench.router --before /tmp/before --model models/qwen3-vl-2b-skeleton --dtype int8 --rounds 2
    python -m bench.router --thresholds 0 1 2 4 --rounds 2

Each round starts `python -m scale` (two replicas of one thread) of each variant, in an order reversed every round,
and sends each three bursts: `--people` people at once with a picture each; one session sending `--people` requests
at once about one picture (one `x-session-id`); and `--people` people at once each holding a conversation, a first
turn and then a follow-up about its picture (the follow-up's TTFT is where keeping a conversation home pays).
Reports wall time, TTFT p50 and max, and the per-round ratios of each variant's to the first's.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from engine.config import DTYPES, PROJECT_DIR

from .cli import machine_line, write_results
from .harness import default_images_dir
from .load import burst, picture_url, served_model
from .scale import conversation, start_cluster, stop_cluster

CASES = ("people", "one session", "conversations")
FIGURES = ("wall_s", "ttft_p50_s", "ttft_max_s")


def conversations(url: str, args) -> dict:
    """`--people` conversations at once: each a first turn about its own picture (none the bursts before used),
    then a follow-up about it; the TTFT figures are the follow-ups'."""
    pictures = [picture_url(args.people + 1 + index, Path(args.images)) for index in range(args.people)]
    began = time.perf_counter()
    with ThreadPoolExecutor(args.people) as pool:
        turns = list(pool.map(lambda picture: conversation(url, picture, args.max_tokens), pictures))
    follow_ups = [follow_up for _, follow_up in turns]
    return {"wall_s": time.perf_counter() - began, "ttft_p50_s": statistics.median(follow_ups),
            "ttft_max_s": max(follow_ups), "errors": 0}


def measure(root: Path, args, folder: Path, tag: str, threshold: int | None) -> dict:
    env = {"VLSCOPE_MODEL": args.model, "VLSCOPE_DTYPE": args.dtype, "VLSCOPE_API_ALLOW_IGNORE_EOS": "on",
           "VLSCOPE_DB": str(folder / f"{tag}.db")}
    if threshold is not None:
        env["VLSCOPE_SCALE_BALANCE_THRESHOLD"] = str(threshold)
    cluster, url = start_cluster(2, 1, env, folder / f"{tag}.log", root=root)
    try:
        model = served_model(f"{url}/v1")
        figures = {}
        for case in CASES:
            if case == "conversations":
                figures[case] = conversations(url, args)
            else:
                result = burst(f"{url}/v1", model, args.people, args.max_tokens, Path(args.images),
                               session=f"bench-{tag}" if case == "one session" else None)
                figures[case] = {"wall_s": result.wall_s, "ttft_p50_s": result.ttft_p50_s,
                                 "ttft_max_s": result.ttft_max_s, "errors": result.errors}
            shown = figures[case]
            print(f"  {tag:12s} {case:13s} wall {shown['wall_s']:6.2f} s  TTFT p50 {shown['ttft_p50_s']:6.2f} s  "
                  f"max {shown['ttft_max_s']:6.2f} s  errors {shown['errors']}", flush=True)
        return figures
    finally:
        stop_cluster(cluster)


def markdown(rounds: list[dict]) -> str:
    """Each variant's medians; the ratios are each round's of a variant to the first variant."""
    variants = list(rounds[0])
    head = "| case | figure | " + " | ".join(variants) + " | " + " | ".join(
        f"{name} / {variants[0]} per round (median)" for name in variants[1:]) + " |"
    lines = [head, "|" + "---|" * (2 + 2 * len(variants) - 1)]
    for case in CASES:
        for figure in FIGURES:
            values = {name: [r[name][case][figure] for r in rounds] for name in variants}
            cells = [f"{statistics.median(values[name]):.2f}" for name in variants]
            for name in variants[1:]:
                ratios = [a / b for a, b in zip(values[name], values[variants[0]])]
                cells.append(f"{', '.join(f'{x:.2f}' for x in ratios)} (**{statistics.median(ratios):.2f}x**)")
            lines.append(f"| {case} | {figure} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.router", description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", help="another checkout to compare (git worktree add /tmp/before <rev>)")
    parser.add_argument("--thresholds", type=int, nargs="*", default=[],
                        help="run this checkout at each VLSCOPE_SCALE_BALANCE_THRESHOLD instead of its setting")
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
        variants = [(f"threshold {n}", PROJECT_DIR, n) for n in args.thresholds] or [("now", PROJECT_DIR, None)]
        variants += [("before", Path(args.before), None)] if args.before else []
        for index in range(args.rounds):
            order = variants if index % 2 == 0 else variants[::-1]
            figures = {name: measure(root, args, Path(folder), f"{name.replace(' ', '')}-{index}", threshold)
                       for name, root, threshold in order}
            rounds.append({name: figures[name] for name, _, _ in variants})
    table = markdown(rounds)
    print(table)
    if args.out:
        write_results(args.out, {"machine": machine_line(), "args": vars(args), "rounds": rounds}, table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
