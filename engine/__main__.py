"""Command line: `python -m engine ask|check-images|bench ...`. Bad input exits 2 with a one-line error."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from .client import Engine
from .config import COMPUTE_DTYPES, DTYPES, EngineConfig
from .errors import VlscopeError
from .inputs.images import check_image
from .inputs.video import VIDEO_SUFFIXES, check_video
from .records.metrics import RequestMetrics
from .request import ChatRequest, TextChunk


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
        + (f" | drafts kept {metrics.drafts_kept}/{metrics.drafted_tokens}" if metrics.drafted_tokens else "")
        + (f" | forced tokens {metrics.forced_tokens}" if metrics.forced_tokens else "")
    )
    gb = 1 << 30
    rows.append(
        f"RSS before {metrics.rss_before_bytes / gb:.2f} GiB | peak {metrics.rss_peak_bytes / gb:.2f} GiB | after "
        f"{metrics.rss_after_bytes / gb:.2f} GiB | weights {metrics.weight_bytes / gb:.2f} GiB"
        + (" | synthetic weights" if metrics.synthetic else "")
    )
    return "\n".join(rows)


def cmd_ask(args) -> int:
    try:
        config = EngineConfig.from_env(
            model=args.model, dtype=args.dtype, compute_dtype=args.compute_dtype, threads=args.threads,
            max_new_tokens=args.max_new_tokens, db_path=args.db, warmup=False if args.no_warmup else None,
        )
    except ValueError as exc:
        return _fail(exc)
    engine = None
    try:
        engine = Engine(config, progress=None if args.json else _progress)
        request = ChatRequest(prompt=args.prompt, images=tuple(args.image or ()), videos=tuple(args.video or ()),
                              source="cli", enhance_for_ocr=args.enhance_for_ocr, video_fps=args.fps)
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
    finally:
        # The worker and compute threads finish their last step before the interpreter does: PyTorch's threads
        # torn down under a running step abort the process.
        if engine is not None:
            engine.close()
    if args.json:
        record = metrics.to_dict()
        record["answer"] = "".join(answer)
        print(json.dumps(record))
    else:
        print(_stage_table(metrics))
    return 0 if metrics.status == "ok" else 1


def cmd_check_images(args) -> int:
    config = EngineConfig.from_env()
    all_ok = True
    for name in args.files:
        verdict = check_video(name, config) if Path(name).suffix.lower() in VIDEO_SUFFIXES else check_image(name, config)
        all_ok &= verdict["ok"]
        print(json.dumps(verdict), flush=True)
    return 0 if all_ok else 2


def _fail(exc: BaseException) -> int:
    print(f"error: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine", description="vlscope engine: Qwen3-VL on the CPU")
    commands = parser.add_subparsers(dest="command", required=True)

    ask = commands.add_parser("ask", help="answer one question about images, with a stage table")
    ask.add_argument("--model", help="hub id, folder with weights, or weightless skeleton folder")
    ask.add_argument("--image", action="append", help="image file (repeatable)")
    ask.add_argument("--video", action="append", help="video clip: mp4, webm, mov, mkv or animated GIF (repeatable)")
    ask.add_argument("--fps", type=float, help="frames sampled a second of each clip (default VLSCOPE_VIDEO_FPS, 2)")
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

    check = commands.add_parser("check-images", help="print a JSON verdict per image, document or video file")
    check.add_argument("files", nargs="+")
    check.set_defaults(run=cmd_check_images)

    commands.add_parser("bench", add_help=False,
                        help="the benchmark sweep: the same as `python -m bench` (its --help lists the options)")

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:
        # The measuring tools sit beside the engine (bench/) and use it as any caller would; this name only hands
        # the rest of the command line over to them, in a process of their own.
        return subprocess.call([sys.executable, "-m", "bench", *argv[1:]])
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
