"""A burst of people asking at once: N concurrent streamed chat completions with different pictures, against a
vlscope server this command starts (or any OpenAI-compatible server with --url), and optionally the same burst
against another server (--against, such as `llama-server -np N`).

    python -m bench.load --model ../shared/qwen3-vl-2b --dtype int8 --clients 4 --max-tokens 64
    python -m bench.load --url http://127.0.0.1:8080/v1 --clients 4 --max-tokens 256

Reports wall time, TTFT p50 and max, end to end p50 and max, tokens per second over the burst, and the longest
pause any stream saw between two of its chunks once it had begun (another request's encode and prefill).

    python -m bench.load --dtype int8 --clients 1 4 --constrained --rounds 2

`--constrained` runs every burst three times, in an order reversed every round: free answers (end tokens ignored),
answers held to an invoice's JSON schema, and the invoice as a forced tool call's arguments, each long enough that
max_tokens cuts it (the same length); it reports the ratios of their decode rates and the tokens a forward pass
gave (a grammar's forced tokens ride along with the step's own: engine_core.jump_forward).
"""
from __future__ import annotations

import argparse
import base64
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
from PIL import Image

from engine.config import DTYPES, PROJECT_DIR
from fixtures.places import shared_dir

from .cli import machine_line, write_results
from .harness import default_images_dir

PROMPT = "Describe this image."
PICTURES = ("astronaut.png", "coffee.png", "chelsea.png", "rocket.jpg", "hubble_deep_field.jpg", "page.png",
            "text.png")


# An invoice with long keys (thirteen fields and nested lines), more lines than any burst's answer holds: every
# constrained answer runs to max_tokens, as the free answers (end tokens ignored) do, so both decode the same number
# of tokens. Strings are bounded: with synthetic weights a string ends only where its schema bounds it.
_TEXT = {"type": "string", "maxLength": 16}
_AMOUNT = {"type": "integer", "minimum": 0, "maximum": 99999}
_LINE = {"type": "object", "additionalProperties": False,
         "required": ["item_description", "quantity_ordered", "unit_price_amount", "line_total_amount"],
         "properties": {"item_description": _TEXT, "quantity_ordered": {"type": "integer", "minimum": 1, "maximum": 99},
                        "unit_price_amount": _AMOUNT, "line_total_amount": _AMOUNT}}
_FIELDS = {"invoice_number": _TEXT, "issue_date": {"type": "string", "format": "date"},
           "due_date": {"type": "string", "format": "date"}, "vendor_name": _TEXT, "vendor_tax_identifier": _TEXT,
           "customer_name": _TEXT, "customer_reference": _TEXT, "currency_code": {"enum": ["EUR", "USD", "GBP"]},
           "payment_terms_days": {"type": "integer", "minimum": 0, "maximum": 90},
           "payment_status": {"enum": ["paid", "unpaid", "partially_paid"]}, "subtotal_amount": _AMOUNT,
           "tax_amount": _AMOUNT, "line_items": {"type": "array", "minItems": 200, "items": _LINE}}
LONG_INVOICE = {"type": "object", "additionalProperties": False, "required": list(_FIELDS), "properties": _FIELDS}
# The same invoice as a forced tool call's arguments.
INVOICE_TOOL = {"type": "function", "function": {"name": "record_invoice", "description": "Record an invoice",
                                                 "parameters": LONG_INVOICE}}
ANSWERS = ("free", "JSON schema", "tool call")


@dataclass
class StreamResult:
    ttft_s: float | None = None
    e2e_s: float = 0.0
    tokens: int = 0
    longest_gap_s: float = 0.0  # between two chunks after the first
    error: str | None = None


@dataclass
class BurstResult:
    server: str
    clients: int
    max_tokens: int
    wall_s: float
    ttft_p50_s: float | None
    ttft_max_s: float | None
    e2e_p50_s: float
    e2e_max_s: float
    tokens_per_s: float
    longest_pause_s: float
    errors: int
    streams: list[StreamResult] = field(default_factory=list)
    # vlscope started here: each decode step's median ms by how many sequences it advanced, from the server's records
    step_ms_by_batch: dict[int, float] = field(default_factory=dict)
    constrained: bool = False  # answers held to a grammar: a JSON schema or a forced tool call
    answer: str = "free"  # ANSWERS
    tokens_per_step: float | None = None  # vlscope started here: answer tokens per forward pass of decode
    decode_tokens_per_s: float | None = None  # vlscope started here: tokens per second of decode and grammar work
    grammar_ms_per_token: float | None = None  # of which the grammar's masks


def picture_url(index: int, images_dir: Path, size: int = 448) -> str:
    """A different real picture per person, resized to the standard request's size, as a data: URL."""
    names = [name for name in PICTURES if (images_dir / name).exists()] or sorted(
        path.name for path in images_dir.iterdir() if path.suffix.lower() in (".png", ".jpg", ".jpeg"))
    picture = Image.open(images_dir / names[index % len(names)]).convert("RGB").resize((size, size), Image.BICUBIC)
    if index >= len(names):  # more people than pictures: mirror, so no two are the same
        picture = picture.transpose(Image.FLIP_LEFT_RIGHT)
    buffer = io.BytesIO()
    picture.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def stream_one(base_url: str, model: str, image_url: str, max_tokens: int, key: str, start: threading.Event,
               result: StreamResult, answer: str = "free", session: str | None = None) -> None:
    body = {"model": model, "stream": True, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image_url}},
                                                       {"type": "text", "text": PROMPT}]}]}
    if answer != "free":  # held to a grammar, the answer ends where its JSON does: no end token to ignore
        del body["ignore_eos"]
    if answer == "JSON schema":
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "invoice", "schema": LONG_INVOICE}}
    elif answer == "tool call":
        body["tools"], body["tool_choice"] = [INVOICE_TOOL], "required"
    headers = ({"Authorization": f"Bearer {key}"} if key else {}) | ({"x-session-id": session} if session else {})
    start.wait()
    began = last = time.perf_counter()
    try:
        with httpx.stream("POST", f"{base_url}/chat/completions", json=body, headers=headers,
                          timeout=httpx.Timeout(1800, connect=30)) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {response.read()[:200]!r}"
                return
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                usage = chunk.get("usage")
                if usage and usage.get("completion_tokens"):
                    result.tokens = int(usage["completion_tokens"])
                texts = [choice.get("delta", {}).get("content") or choice.get("delta", {}).get("tool_calls")
                         for choice in chunk.get("choices", [])]
                if not any(texts):
                    continue
                now = time.perf_counter()
                if result.ttft_s is None:
                    result.ttft_s = now - began
                else:
                    result.longest_gap_s = max(result.longest_gap_s, now - last)
                last = now
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    finally:
        result.e2e_s = time.perf_counter() - began


def burst(base_url: str, model: str, clients: int, max_tokens: int, images_dir: Path, key: str = "",
          answer: str = "free", session: str | None = None) -> BurstResult:
    """`clients` streams at once, each about a picture of its own; with `session`, one person's: all about one
    picture (one the burst without a session does not use), under one session header."""
    urls = [picture_url(clients if session else index, images_dir) for index in range(clients)]
    start = threading.Event()
    results = [StreamResult() for _ in range(clients)]
    threads = [threading.Thread(target=stream_one, args=(base_url, model, url, max_tokens, key, start, result, answer,
                                                         session))
               for url, result in zip(urls, results)]
    for thread in threads:
        thread.start()
    began = time.perf_counter()
    start.set()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - began
    good = [result for result in results if result.error is None]
    ttfts = [result.ttft_s for result in good if result.ttft_s is not None]
    e2es = [result.e2e_s for result in good] or [wall]
    return BurstResult(
        server=base_url, clients=clients, max_tokens=max_tokens, wall_s=wall,
        ttft_p50_s=statistics.median(ttfts) if ttfts else None, ttft_max_s=max(ttfts) if ttfts else None,
        e2e_p50_s=statistics.median(e2es), e2e_max_s=max(e2es),
        tokens_per_s=sum(result.tokens for result in good) / wall,
        longest_pause_s=max((result.longest_gap_s for result in good), default=0.0),
        errors=len(results) - len(good), streams=results, constrained=answer != "free", answer=answer)


def server_figures(result: BurstResult, db: Path, since: float) -> None:
    """From vlscope's own records of the burst (finished after `since`): the median decode step by batch size, and
    the answers' tokens per second of decode, grammar and detokenizing together, with the grammar's part."""
    from engine import MetricsStore
    from engine.records.stages import DECODE, DETOKENIZE, GRAMMAR

    steps: dict[int, list[float]] = {}
    tokens, forced, seconds, grammar = 0, 0, 0.0, 0.0
    for record in MetricsStore(db).between(since):
        if record.warmup:
            continue
        for size, step in zip(record.decode_batch_sizes, record.token_latencies_s):
            steps.setdefault(size, []).append(step)
        tokens += len(record.token_latencies_s)
        forced += record.forced_tokens
        grammar += record.stages.get(GRAMMAR, 0.0)
        seconds += sum(record.stages.get(name, 0.0) for name in (DECODE, DETOKENIZE, GRAMMAR))
    result.step_ms_by_batch = {size: 1000 * statistics.median(values) for size, values in sorted(steps.items())}
    if tokens:
        result.tokens_per_step = tokens / (tokens - forced)
        result.decode_tokens_per_s = tokens / seconds
        result.grammar_ms_per_token = 1000 * grammar / tokens


def start_vlscope(model: str, dtype: str, workdir: Path, env_overrides: dict[str, str]) -> tuple[subprocess.Popen, str]:
    """`uvicorn streamlit_app:app` on a free port with ignore_eos allowed (fixed-length answers); waits until the
    model is loaded and warmed up."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = dict(os.environ, VLSCOPE_MODEL=model, VLSCOPE_DTYPE=dtype, VLSCOPE_DB=str(workdir / "load.db"),
               VLSCOPE_API_ALLOW_IGNORE_EOS="on", VLSCOPE_MAX_QUEUE="64") | env_overrides
    log = open(workdir / "server.log", "w")
    server = subprocess.Popen([sys.executable, "-m", "uvicorn", "streamlit_app:app", "--host", "127.0.0.1",
                               "--port", str(port)], cwd=PROJECT_DIR, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 900
    while time.time() < deadline and server.poll() is None:
        try:
            if httpx.get(f"{base}/health", timeout=2).json().get("status") == "ready":
                return server, f"{base}/v1"
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(1)
    server.kill()
    raise RuntimeError(f"the server did not become ready; see {workdir / 'server.log'}")


def served_model(base_url: str, key: str = "") -> str:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    models = httpx.get(f"{base_url}/models", headers=headers, timeout=30).json().get("data", [])
    return models[0]["id"] if models else "default"


def markdown(results: list[BurstResult]) -> str:
    steps = [r for r in results if r.step_ms_by_batch]
    lines = []
    for r in steps:
        one = r.step_ms_by_batch.get(1)
        cells = ", ".join(f"{size}: {ms:.1f} ms" + (f" ({size * one / ms:.2f}x one stream's tokens/s)" if one else "")
                          for size, ms in r.step_ms_by_batch.items())
        lines.append(f"Decode step by sequences in it ({r.max_tokens}-token burst): {cells}")
    lines += [""] if lines else []
    lines += ["| server | answer | people | answer tokens | wall s | TTFT p50 / max s | end to end p50 / max s | "
              "tokens/s over the burst | decode tokens/s (grammar ms a token) | tokens a step | longest pause s | "
              "errors |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        ttft = f"{r.ttft_p50_s:.1f} / {r.ttft_max_s:.1f}" if r.ttft_p50_s is not None else "–"
        decode = (f"{r.decode_tokens_per_s:.2f} ({r.grammar_ms_per_token:.2f})" if r.decode_tokens_per_s else "–")
        per_step = f"{r.tokens_per_step:.2f}" if r.tokens_per_step else "–"
        lines.append(f"| {r.server} | {r.answer} | {r.clients} | {r.max_tokens} | "
                     f"{r.wall_s:.1f} | {ttft} | {r.e2e_p50_s:.1f} / {r.e2e_max_s:.1f} | {r.tokens_per_s:.2f} | "
                     f"{decode} | {per_step} | {r.longest_pause_s:.2f} | {r.errors} |")
    return "\n".join(lines + constrained_ratios(results))


def constrained_ratios(results: list[BurstResult]) -> list[str]:
    """Constrained over free, by people: each round's pair (run one after the other) as a ratio of decode rates
    and of burst rates, and the median of those ratios."""
    lines = []
    for answer in ANSWERS[1:]:
        for clients in sorted({r.clients for r in results if r.answer == answer}):
            pairs = list(zip([r for r in results if r.clients == clients and r.answer == "free"],
                             [r for r in results if r.clients == clients and r.answer == answer]))
            if not pairs:
                continue
            decode = [(held.decode_tokens_per_s or 0) / max(free.decode_tokens_per_s or 0, 1e-9)
                      for free, held in pairs]
            burst = [held.tokens_per_s / max(free.tokens_per_s, 1e-9) for free, held in pairs]
            lines.append(f"{answer} over free answers, {clients} {'person' if clients == 1 else 'people'}, "
                         f"{len(pairs)} rounds: decode {statistics.median(decode):.3f}x "
                         f"({', '.join(f'{x:.2f}' for x in decode)}), burst {statistics.median(burst):.3f}x "
                         f"({', '.join(f'{x:.2f}' for x in burst)})")
    return [""] + lines if lines else []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.load", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(shared_dir() / "qwen3-vl-2b"))
    parser.add_argument("--dtype", default="int8", choices=DTYPES)
    parser.add_argument("--clients", type=int, nargs="+", default=[4])
    parser.add_argument("--max-tokens", type=int, nargs="+", default=[64])
    parser.add_argument("--max-batch", type=int, help="VLSCOPE_MAX_BATCH for the vlscope server this starts")
    parser.add_argument("--url", help="an OpenAI-compatible server to measure instead of starting vlscope")
    parser.add_argument("--against", help="another OpenAI-compatible server to run the same bursts against")
    parser.add_argument("--api-key", default="")
    parser.add_argument("--images", default=str(default_images_dir()))
    parser.add_argument("--out", help="write the results here as JSON, and a markdown table beside it")
    parser.add_argument("--constrained", action="store_true",
                        help="alternate each burst with one whose answers are held to a JSON schema")
    parser.add_argument("--rounds", type=int, default=1, help="times each burst runs (alternating with --constrained)")
    args = parser.parse_args(argv)
    images = Path(args.images)
    results: list[BurstResult] = []
    with tempfile.TemporaryDirectory() as work:
        server = None
        if args.url:
            base = args.url.rstrip("/")
        else:
            overrides = {"VLSCOPE_MAX_BATCH": str(args.max_batch)} if args.max_batch else {}
            server, base = start_vlscope(args.model, args.dtype, Path(work), overrides)
        try:
            targets = [base] + ([args.against.rstrip("/")] if args.against else [])
            answers = ANSWERS if args.constrained else ANSWERS[:1]
            runs = [(clients, tokens, target, answers[::-1] if turn % 2 else answers) for clients in args.clients
                    for tokens in args.max_tokens for turn in range(args.rounds) for target in targets]
            runs = [(clients, tokens, target, answer) for clients, tokens, target, order in runs for answer in order]
            for clients, tokens, target, answer in runs:
                since = time.time()
                result = burst(target, served_model(target, args.api_key), clients, tokens, images, args.api_key,
                               answer)
                if server is not None and target == base:
                    server_figures(result, Path(work) / "load.db", since)
                results.append(result)
                print(markdown([result]).splitlines()[-1], file=sys.stderr, flush=True)
        finally:
            if server is not None:
                server.terminate()
                server.wait(60)
    text = (f"{machine_line()}; "
            + (f"server at {args.url}" if args.url else
               f"vlscope {args.dtype}{f', max batch {args.max_batch}' if args.max_batch else ''}")
            + f"\n\n{markdown(results)}\n")
    print(text)
    if args.out:
        write_results(args.out, [asdict(result) for result in results], text)
    return 0 if all(result.errors == 0 for result in results) else 1


if __name__ == "__main__":
    sys.exit(main())
