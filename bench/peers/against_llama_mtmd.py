"""The standard request, A B A B: vlscope (`python -m engine ask`, a warm process per request) against llama.cpp's
`llama-mtmd-cli`, which prints no timings of its own in this build, so it is timed from outside: TTFT from its log
line "encoding mtmd batch" (the request's start, after load) to the first answer bytes on its stdout, decode over
the remaining tokens (it streams one token a write), peak RSS polled.

usage (from the repository root):
  python -m bench.peers.against_llama_mtmd ROUNDS TOKENS DTYPE LLAMA_BIN MODEL_GGUF
      MMPROJ_GGUF IMAGE OUT_JSON [SETTING ...]

Each SETTING (as VLSCOPE_DRAFT=off) makes vlscope a side of its own with that setting in its environment, so one
interleaved run compares vlscope before and after a change against the same peer; without any, one vlscope side.
"""
import json
import os
import select
import statistics
import subprocess
import sys
import time

import psutil

rounds, tokens, dtype, llama_bin, model, mmproj, image, out = sys.argv[1:9]
rounds, tokens = int(rounds), int(tokens)
settings = sys.argv[9:] or [""]


def llama() -> dict:
    command = [f"{llama_bin}/llama-mtmd-cli", "-m", model, "--mmproj", mmproj, "--image", image, "-p",
               "Describe this image.", "-n", str(tokens), "-t", "2", "-c", "4096", "--temp", "0", "--ignore-eos"]
    started = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    watched, peak = psutil.Process(process.pid), 0
    streams = {process.stdout.fileno(): "out", process.stderr.fileno(): "err"}
    log, arrivals, request_start = b"", [], None
    while streams:
        ready, _, _ = select.select(list(streams), [], [], 0.05)
        try:
            peak = max(peak, watched.memory_info().rss)
        except psutil.Error:
            pass
        for fd in ready:
            chunk, now = os.read(fd, 65536), time.perf_counter() - started
            if not chunk:
                streams.pop(fd)
            elif streams[fd] == "err":
                log += chunk
                if request_start is None and b"encoding mtmd batch" in log:
                    request_start = now
            elif chunk.strip():
                arrivals.append(now)
    process.wait()
    return {"ttft_s": arrivals[0] - request_start, "decode_tokens_per_s": (tokens - 1) / (arrivals[-1] - arrivals[0]),
            "e2e_s": arrivals[-1] - request_start, "rss_peak_gb": peak / 1e9, "writes": len(arrivals)}


def vlscope(setting: str) -> dict:
    environment = dict(os.environ, **dict([setting.split("=", 1)])) if setting else None
    result = subprocess.run([sys.executable, "-m", "engine", "ask", "--model", "models/qwen3-vl-2b-skeleton", "--image",
                             image, "--prompt", "Describe this image.", "--dtype", dtype, "--max-new-tokens",
                             str(tokens), "--db", f"{out}.sqlite", "--json"], capture_output=True, text=True, env=environment)
    record = json.loads(result.stdout[result.stdout.index("{"):])
    return {"ttft_s": record["ttft_s"], "decode_tokens_per_s": record["decode_tokens_per_s"], "e2e_s": record["e2e_s"],
            "rss_peak_gb": record["rss_peak_bytes"] / 1e9, "stages": record["stages"]}


sides = {f"vlscope {setting}".strip(): setting for setting in settings}
rows = {side: [] for side in [*sides, "llama.cpp"]}
for round_ in range(rounds):
    order = list(rows) if round_ % 2 == 0 else list(reversed(rows))
    for side in order:
        rows[side].append(llama() if side == "llama.cpp" else vlscope(sides[side]))
        print(round_ + 1, side, {k: round(v, 3) for k, v in rows[side][-1].items() if isinstance(v, float)}, flush=True)
keys = ("ttft_s", "decode_tokens_per_s", "e2e_s", "rss_peak_gb")
medians = {side: {k: statistics.median(r[k] for r in runs) for k in keys} for side, runs in rows.items()}
ratios = {side: {k: [round(a[k] / b[k], 3) for a, b in zip(rows[side], rows["llama.cpp"])] for k in keys[:3]}
          for side in sides}
print(json.dumps({"medians": medians, "ratios per round": ratios}, indent=1))
with open(out, "w") as handle:
    json.dump({"tokens": tokens, "dtype": dtype, "model": model, "rounds": rows, "medians": medians,
               "ratios_per_round": ratios}, handle, indent=1)
