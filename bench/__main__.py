"""`python -m bench [--quick] [--record] [--against URL]`: what a request costs on this CPU, per precision, thread
count, image size and path; JSON, markdown and HTML in one folder (with --record, this CPU kind's record in
docs/bench/<kind>/, the one the Benchmark page shows). Bad input exits 2 with a one-line error."""
from __future__ import annotations

import argparse
import datetime as dt
import sys
import time
from pathlib import Path

from engine.config import EngineConfig
from engine.errors import VlscopeError

from .cli import fail, progress_printer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench",
                                     description="measure precision, threads, image sizes and paths on this CPU")
    parser.add_argument("--quick", action="store_true", help="the small sweep (under 10 minutes on 2 cores)")
    parser.add_argument("--model", help="default: VLSCOPE_MODEL if it has weights, else the bundled skeleton")
    parser.add_argument("--repeats", type=int, help="measured runs per case (default 2 quick, 5 full)")
    parser.add_argument("--images", help="folder with astronaut.png or coffee.png (default ../shared/images)")
    parser.add_argument("--out", help="output folder (default bench-results/<time>)")
    parser.add_argument("--record", action="store_true",
                        help="write the run as this CPU kind's record, docs/bench/<kind>/, replacing the one there")
    parser.add_argument("--db", help="metrics database for the engine's records")
    parser.add_argument("--no-drift", action="store_true", help="skip the precision drift measurement")
    parser.add_argument("--against", metavar="URL",
                        help="also send each precision's request to this OpenAI-compatible server (llama.cpp's "
                             "llama-server, vLLM, Ollama, another vlscope), interleaved, and report the ratios")
    args = parser.parse_args(argv)
    if args.record and args.out:
        parser.error("--record writes to docs/bench/<kind>/: leave out --out")
    from engine.machine import system_report
    from speed.record import LOCAL_RUNS, record_dir

    from .harness import (  # torch: after --help
        default_images_dir,
        default_model,
        run_bench,
    )

    images = Path(args.images) if args.images else default_images_dir()
    if args.record:
        out = record_dir(system_report().cpu_kind)
    else:
        out = Path(args.out) if args.out else LOCAL_RUNS / dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    repeats = args.repeats or (2 if args.quick else 5)
    started = time.perf_counter()
    try:
        result = run_bench(args.model or default_model(), args.quick, repeats, images, out,
                             args.db or EngineConfig.from_env().db_path, progress_printer(),
                             drift=not args.no_drift, against=args.against, html=not args.record)
    except VlscopeError as exc:  # the compared server is down, refuses the key, or fails a request
        return fail(exc)
    print((out / "bench.md").read_text())
    print(f"wrote {out}/bench.json, bench.md{'' if args.record else ', bench.html'} in {time.perf_counter() - started:.0f} s "
          f"({len(result.cases)} cases)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
