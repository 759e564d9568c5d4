"""The cluster measured against the same engine served directly, in one run (`python -m scale` started here):

    python -m bench.scale --model ../shared/qwen3-vl-2b --dtype int8 --rounds 3 --out bench-results/scale.json

1. Proxy overhead: the standard request's first turn and a follow-up about the same picture, streamed, alternating
   direct (`uvicorn streamlit_app:app`) and cluster (one replica of the same threads), a new picture each round;
   reports both TTFTs and their ratios.
2. Layouts on this machine: a burst of `--clients` people through one replica of all the threads, then through
   one replica per thread; wall time, TTFT and tokens per second, as measured.
3. Memory: each replica's RSS and Ray's own processes (proxy, controller, front, GCS, raylet, agents) together.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

from engine.config import DTYPES, PROJECT_DIR
from fixtures.places import shared_dir

from .cli import machine_line, write_results
from .harness import default_images_dir
from .load import PROMPT, burst, picture_url, served_model, start_vlscope

REPLICA_PROCESS = "ServeReplica:vlscope:Replica"  # a replica's process title (Ray names its actors' processes)


def start_cluster(replicas: int, threads: int, env: dict[str, str], log: Path, key: str = "",
                  timeout_s: float = 900, flags: tuple[str, ...] = (),
                  root: Path = PROJECT_DIR) -> tuple[subprocess.Popen, str]:
    """`python -m scale` of the checkout at `root` (with `flags` besides) on a free port; waits until `replicas`
    replicas report ready. The URL has no /v1."""
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    process = subprocess.Popen([sys.executable, "-m", "scale", "--replicas", str(replicas), "--threads",
                                str(threads), "--port", str(port), *flags], cwd=root, env=dict(os.environ) | env,
                               stdout=open(log, "w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    deadline = time.time() + timeout_s
    while time.time() < deadline and process.poll() is None:
        try:
            health = httpx.get(f"{url}/health", headers=headers, timeout=5)
            if health.status_code == 200 and len(health.json().get("replicas", [])) == replicas:
                return process, url
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(1)
    stop_cluster(process)
    raise RuntimeError(f"the cluster did not start; see {log}:\n" + log.read_text()[-2000:])


def stop_cluster(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(10)


def cluster_memory(process: subprocess.Popen) -> dict:
    """RSS of each replica process and of everything else the cluster runs, in GB."""
    replicas, ray_own = [], 0
    for proc in [psutil.Process(process.pid), *psutil.Process(process.pid).children(recursive=True)]:
        try:
            rss, title = proc.memory_info().rss, " ".join(proc.cmdline())
        except psutil.NoSuchProcess:
            continue
        if REPLICA_PROCESS in title:
            replicas.append(rss / 1e9)
        else:
            ray_own += rss
    return {"replicas_gb": sorted(replicas), "ray_gb": ray_own / 1e9}


def turn_ttft(base: str, messages: list, max_tokens: int) -> tuple[float, str]:
    """Seconds to the first answer text of a streamed request, and the whole answer."""
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True}
    began, first, parts = time.perf_counter(), None, []
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            text = "".join(c.get("delta", {}).get("content") or "" for c in json.loads(line[6:]).get("choices", []))
            if text and first is None:
                first = time.perf_counter() - began
            parts.append(text)
    return first, "".join(parts)


def conversation(base: str, picture: str, max_tokens: int) -> tuple[float, float]:
    """TTFT of the first turn about a picture and of a follow-up about it."""
    history = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": picture}},
                                            {"type": "text", "text": PROMPT}]}]
    first, answer = turn_ttft(base, history, max_tokens)
    history += [{"role": "assistant", "content": answer}, {"role": "user", "content": "What else is in it?"}]
    follow_up, _ = turn_ttft(base, history, max_tokens)
    return first, follow_up


def round_trip_s(base: str, text: str) -> float:
    """Seconds for a one-token answer to a short text: the path's own cost, next to no model work."""
    began = time.perf_counter()
    httpx.post(f"{base}/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": text}], "max_tokens": 1, "temperature": 0}).raise_for_status()
    return time.perf_counter() - began


def path_overhead(targets: dict[str, str], rounds: int = 20) -> dict:
    """Median round trip of each path over `rounds` alternating one-token requests, in milliseconds."""
    times = {name: [] for name in targets}
    for number in range(rounds):
        for name in (list(targets) if number % 2 == 0 else list(targets)[::-1]):
            times[name].append(round_trip_s(targets[name], f"Say one word, {number}."))
    return {f"{name}_ms": 1000 * statistics.median(values) for name, values in times.items()}


def markdown(result: dict) -> str:
    rows = ["| round | order | direct first TTFT s | cluster first TTFT s | ratio | direct follow-up TTFT s | "
            "cluster follow-up TTFT s | ratio |", "|---|---|---|---|---|---|---|---|"]
    for number, item in enumerate(result["rounds"], 1):
        d, c = item["direct"], item["cluster"]
        rows.append(f"| {number} | {item['order']} | {d[0]:.3f} | {c[0]:.3f} | {c[0] / d[0]:.3f} | {d[1]:.3f} | "
                    f"{c[1]:.3f} | {c[1] / d[1]:.3f} |")
    medians = result["medians"]
    rows.append(f"| median | | {medians['direct_first']:.3f} | {medians['cluster_first']:.3f} | "
                f"{medians['first_ratio']:.3f} | {medians['direct_follow_up']:.3f} | "
                f"{medians['cluster_follow_up']:.3f} | {medians['follow_up_ratio']:.3f} |")
    overhead = result["round_trip"]
    rows += ["", f"One-token answers to a short text, 20 alternating: direct {overhead['direct_ms']:.1f} ms, cluster "
                 f"{overhead['cluster_ms']:.1f} ms (medians): the proxy and the front add "
                 f"{overhead['cluster_ms'] - overhead['direct_ms']:.1f} ms."]
    rows += ["", "| layout | clients | wall s | TTFT p50 s | TTFT max s | tokens/s | errors |",
             "|---|---|---|---|---|---|---|"]
    for layout in result["layouts"]:
        rows.append(f"| {layout['layout']} | {layout['clients']} | {layout['wall_s']:.2f} | "
                    f"{layout['ttft_p50_s']:.2f} | {layout['ttft_max_s']:.2f} | {layout['tokens_per_s']:.1f} | "
                    f"{layout['errors']} |")
    rows += ["", "| layout | each replica's RSS GB | Ray's own processes GB |", "|---|---|---|"]
    rows += [f"| {m['layout']} | {', '.join(f'{gb:.2f}' for gb in m['replicas_gb'])} | {m['ray_gb']:.2f} |"
             for m in result["memory"]]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(shared_dir() / "qwen3-vl-2b"))
    parser.add_argument("--dtype", default="int8", choices=DTYPES)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="the machine's threads to share")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--images", default=str(default_images_dir()))
    parser.add_argument("--out", help="write the results here as JSON, and a markdown table beside it")
    args = parser.parse_args(argv)
    images = Path(args.images)
    result = {"rounds": [], "layouts": [], "memory": []}
    with tempfile.TemporaryDirectory() as work:
        folder = Path(work)
        env = {"VLSCOPE_MODEL": args.model, "VLSCOPE_DTYPE": args.dtype, "VLSCOPE_API_ALLOW_IGNORE_EOS": "on",
               "VLSCOPE_MAX_QUEUE": "64", "VLSCOPE_DB": str(folder / "cluster.db")}
        direct, direct_v1 = start_vlscope(args.model, args.dtype, folder, {"VLSCOPE_THREADS": str(args.threads)})
        cluster, url = start_cluster(1, args.threads, env, folder / "scale-1.log")
        try:
            targets = {"direct": direct_v1.removesuffix("/v1"), "cluster": url}
            for number in range(args.rounds):
                order = ["direct", "cluster"] if number % 2 == 0 else ["cluster", "direct"]
                item = {"order": " / ".join(order)}
                for offset, name in enumerate(order):  # each its own picture: no cache from the other's turn
                    item[name] = conversation(targets[name], picture_url(2 * number + offset, images),
                                              args.max_tokens)
                result["rounds"].append(item)
                print(item, file=sys.stderr, flush=True)
            result["round_trip"] = path_overhead(targets)
            result["memory"].append({"layout": f"1 x {args.threads} threads"} | cluster_memory(cluster))
            layout = burst(f"{url}/v1", served_model(f"{url}/v1"), args.clients, args.max_tokens, images)
            result["layouts"].append({"layout": f"1 replica x {args.threads} threads"} | _summary(layout))
        finally:
            stop_cluster(cluster)
            direct.terminate()
            direct.wait(60)
        cluster, url = start_cluster(args.threads, 1, env, folder / "scale-n.log")
        try:
            result["memory"].append({"layout": f"{args.threads} x 1 thread"} | cluster_memory(cluster))
            layout = burst(f"{url}/v1", served_model(f"{url}/v1"), args.clients, args.max_tokens, images)
            result["layouts"].append({"layout": f"{args.threads} replicas x 1 thread"} | _summary(layout))
        finally:
            stop_cluster(cluster)
    pairs = result["rounds"]
    result["medians"] = {
        "direct_first": statistics.median(p["direct"][0] for p in pairs),
        "cluster_first": statistics.median(p["cluster"][0] for p in pairs),
        "direct_follow_up": statistics.median(p["direct"][1] for p in pairs),
        "cluster_follow_up": statistics.median(p["cluster"][1] for p in pairs),
        "first_ratio": statistics.median(p["cluster"][0] / p["direct"][0] for p in pairs),
        "follow_up_ratio": statistics.median(p["cluster"][1] / p["direct"][1] for p in pairs)}
    text = f"{machine_line()}; vlscope {args.dtype}, {args.max_tokens} tokens\n\n{markdown(result)}\n"
    print(text)
    if args.out:
        write_results(args.out, result, text)
    return 0


def _summary(result) -> dict:
    return {"clients": result.clients, "wall_s": result.wall_s, "ttft_p50_s": result.ttft_p50_s or 0.0,
            "ttft_max_s": result.ttft_max_s or 0.0, "tokens_per_s": result.tokens_per_s, "errors": result.errors}


if __name__ == "__main__":
    sys.exit(main())
