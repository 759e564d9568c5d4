"""Command line: `python -m engine ask|check-images|make-tiny ...`. Bad input exits 2 with a one-line error."""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from .config import COMPUTE_DTYPES, DTYPES, SKELETON_DIR, EngineConfig


def _progress(fraction: float, message: str) -> None:
    print(f"[{fraction * 100:3.0f}%] {message}", file=sys.stderr, flush=True)


def _stage_table(metrics) -> str:
    rows = [f"{'stage':<14}{'seconds':>10}"]
    rows += [f"{name:<14}{seconds:>10.3f}" for name, seconds in metrics.stages.items()]
    rows.append(f"{'queue wait':<14}{metrics.queue_wait_s:>10.3f}")
    rows.append(f"{'end to end':<14}{metrics.e2e_s:>10.3f}")
    rate = f"{metrics.decode_tokens_per_s:.2f}" if metrics.decode_tokens_per_s else "-"
    ttft = f"{metrics.ttft_s:.3f} s" if metrics.ttft_s is not None else "-"
    read = f" ({metrics.decode_gb_per_s:.1f} GB/s of weights)" if metrics.decode_gb_per_s else ""
    rows.append(
        f"TTFT {ttft} | decode {rate} tok/s{read} | vision tokens {metrics.vision_tokens} | prompt tokens "
        f"{metrics.prompt_tokens} | output tokens {metrics.output_tokens}"
    )
    gb = 1 << 30
    rows.append(
        f"RSS before {metrics.rss_before_bytes / gb:.2f} GiB | peak {metrics.rss_peak_bytes / gb:.2f} GiB | after "
        f"{metrics.rss_after_bytes / gb:.2f} GiB | weights {metrics.weight_bytes / gb:.2f} GiB"
        + (" | synthetic weights" if metrics.synthetic else "")
    )
    return "\n".join(rows)


def cmd_ask(args) -> int:
    from .engine import Engine
    from .errors import VlscopeError
    from .metrics import RequestMetrics
    from .request import ChatRequest, TextChunk

    try:
        config = EngineConfig.from_env(
            model=args.model, dtype=args.dtype, compute_dtype=args.compute_dtype, threads=args.threads,
            max_new_tokens=args.max_new_tokens, db_path=args.db, warmup=False if args.no_warmup else None,
        )
    except ValueError as exc:
        return _fail(exc)
    try:
        engine = Engine(config, progress=None if args.json else _progress)
        request = ChatRequest(prompt=args.prompt, images=tuple(args.image or ()), source="cli",
                              enhance_for_ocr=args.enhance_for_ocr)
        answer: list[str] = []
        out = sys.stderr if args.json else sys.stdout
        for event in engine.stream(request):
            if isinstance(event, TextChunk):
                answer.append(event.text)
                print(event.text, end="", file=out, flush=True)
            elif isinstance(event, RequestMetrics):
                metrics = event
        print(file=out)
    except VlscopeError as exc:
        return _fail(exc)
    if args.json:
        record = metrics.to_dict()
        record["answer"] = "".join(answer)
        print(json.dumps(record))
    else:
        print(_stage_table(metrics))
    return 0 if metrics.status == "ok" else 1


def cmd_check_images(args) -> int:
    from .images import check_image

    config = EngineConfig.from_env()
    all_ok = True
    for name in args.files:
        verdict = check_image(name, min_pixels=config.min_pixels, max_pixels=config.max_pixels,
                              max_image_pixels=config.max_image_pixels, max_bytes=config.max_image_bytes)
        all_ok &= verdict["ok"]
        print(json.dumps(verdict), flush=True)
    return 0 if all_ok else 2


def cmd_make_tiny(args) -> int:
    from .model_loading import make_tiny

    path = make_tiny(args.skeleton, args.outdir)
    print(path)
    return 0


def cmd_bench(args) -> int:
    import datetime as dt

    from .bench import default_images_dir, default_model, run_bench

    images = Path(args.images) if args.images else default_images_dir()
    out = Path(args.out) if args.out else Path("bench-results") / dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    repeats = args.repeats or (2 if args.quick else 5)
    from .errors import VlscopeError

    started = time.perf_counter()
    try:
        document = run_bench(args.model or default_model(), args.quick, repeats, images, out,
                             args.db or EngineConfig.from_env().db_path,
                             lambda fraction, message: print(f"[{time.perf_counter() - started:6.0f}s "
                                                             f"{fraction * 100:3.0f}%] {message}", file=sys.stderr,
                                                             flush=True),
                             drift=not args.no_drift, against=args.against)
    except VlscopeError as exc:  # the compared server is down, refuses the key, or fails a request
        return _fail(exc)
    print((out / "bench.md").read_text())
    print(f"wrote {out}/bench.json, bench.md, bench.html in {time.perf_counter() - started:.0f} s "
          f"({len(document['cases'])} cases)", file=sys.stderr)
    return 0


def cmd_soak(args) -> int:
    import tempfile

    from .soak import soak

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="vlscope-soak-"))
    workdir.mkdir(parents=True, exist_ok=True)
    result = soak(args.model or EngineConfig.from_env().model, args.requests, args.clients, args.seconds, workdir,
                  report=lambda message: print(message, file=sys.stderr, flush=True),
                  app_sessions=args.app_sessions, app_chats=args.app_chats)
    print(json.dumps(result, indent=1))
    healthy = (result["one_record_per_request"] and result["server_errors"] == 0 and result["rss_growth"] < 0.05
               and result["health_at_end"] == "ready" and "app:no-answer" not in result["outcomes"])
    return 0 if healthy else 1


def _fail(exc: BaseException) -> int:
    print(f"error: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}", file=sys.stderr)
    return 2


def cmd_tune(args) -> int:
    from .bench import default_images_dir, default_model
    from .tuning import markdown, tune

    try:
        config = EngineConfig(model=args.model or default_model(), dtype=args.dtype, threads=args.threads or
                              EngineConfig().threads, warmup=False)
    except ValueError as exc:
        return _fail(exc)
    lines: list[str] = []

    def report(line: str) -> None:
        lines.append(line)
        print(line, flush=True)

    image = Path(args.image) if args.image else default_images_dir() / "coffee.png"
    trials = tune(config, image, new_tokens=args.new_tokens, repeats=args.repeats,
                  compile_=not args.no_compile, report=report)
    table = markdown(trials, "# Implementation choices measured by `python -m engine tune`\n\n" + lines[0])
    print(table)
    if args.out:
        Path(args.out).write_text(table + "\n" + "\n".join(f"    {line}" for line in lines) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine", description="vlscope engine: Qwen3-VL on the CPU")
    commands = parser.add_subparsers(dest="command", required=True)

    ask = commands.add_parser("ask", help="answer one question about images, with a stage table")
    ask.add_argument("--model", help="hub id, folder with weights, or weightless skeleton folder")
    ask.add_argument("--image", action="append", help="image file (repeatable)")
    ask.add_argument("--prompt", required=True)
    ask.add_argument("--dtype", choices=DTYPES)
    ask.add_argument("--compute-dtype", choices=COMPUTE_DTYPES,
                     help="what bfloat16/int8 weights compute in (default auto: measured on this CPU)")
    ask.add_argument("--threads", type=int)
    ask.add_argument("--max-new-tokens", type=int)
    ask.add_argument("--db", help="metrics database (default data/vlscope.db)")
    ask.add_argument("--enhance-for-ocr", action="store_true")
    ask.add_argument("--no-warmup", action="store_true", help="skip the warm-up request at load")
    ask.add_argument("--json", action="store_true", help="print the metrics record as JSON (answer on stderr)")
    ask.set_defaults(run=cmd_ask)

    check = commands.add_parser("check-images", help="print a JSON verdict per image file")
    check.add_argument("files", nargs="+")
    check.set_defaults(run=cmd_check_images)

    tiny = commands.add_parser("make-tiny", help="write a tiny Qwen3-VL of the same family for tests")
    tiny.add_argument("outdir")
    tiny.add_argument("--skeleton", default=str(SKELETON_DIR))
    tiny.set_defaults(run=cmd_make_tiny)

    bench = commands.add_parser("bench", help="measure precision, threads, image sizes and paths on this CPU")
    bench.add_argument("--quick", action="store_true", help="the small sweep (under 10 minutes on 2 cores)")
    bench.add_argument("--model", help="default: VLSCOPE_MODEL if it has weights, else the bundled skeleton")
    bench.add_argument("--repeats", type=int, help="measured runs per case (default 2 quick, 5 full)")
    bench.add_argument("--images", help="folder with astronaut.png or coffee.png (default ../shared/images)")
    bench.add_argument("--out", help="output folder (default bench-results/<time>)")
    bench.add_argument("--db", help="metrics database for the engine's records")
    bench.add_argument("--no-drift", action="store_true", help="skip the precision drift measurement")
    bench.add_argument("--against", metavar="URL",
                       help="also send each precision's request to this OpenAI-compatible server (llama.cpp's "
                            "llama-server, vLLM, Ollama, another vlscope), interleaved, and report the ratios")
    bench.set_defaults(run=cmd_bench)

    tune = commands.add_parser("tune", help="measure attention implementation, cache kind and torch.compile")
    tune.add_argument("--model", help="default: as for bench")
    tune.add_argument("--dtype", choices=DTYPES, default="float32")
    tune.add_argument("--threads", type=int)
    tune.add_argument("--image", help="default: coffee.png from the images folder bench uses")
    tune.add_argument("--new-tokens", type=int, default=32)
    tune.add_argument("--repeats", type=int, default=2)
    tune.add_argument("--no-compile", action="store_true")
    tune.add_argument("--out", help="also write the table here (markdown)")
    tune.set_defaults(run=cmd_tune)

    soak = commands.add_parser("soak", help="bounded load and fault run against a local server")
    soak.add_argument("--model", help="model for the server (default VLSCOPE_MODEL)")
    soak.add_argument("--requests", type=int, default=200)
    soak.add_argument("--clients", type=int, default=4)
    soak.add_argument("--seconds", type=float, default=1800, help="stop sending after this long")
    soak.add_argument("--app-sessions", type=int, default=1, help="browser sessions on the chat page (Chromium)")
    soak.add_argument("--app-chats", type=int, default=3, help="questions each browser session asks")
    soak.add_argument("--workdir", help="where the server's database and log go (default a temp folder)")
    soak.set_defaults(run=cmd_soak)

    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
