"""bfloat16 decode compiled (VLSCOPE_COMPILE=on) against eager on fbgemm's float16 copy (auto), full-size skeleton with
synthetic weights, standard request (448x448, 64 tokens) and an 8-token follow-up on the same image, 2 threads.
Both engines live in one process and take turns, so the machine's noise hits both alike.

Run from the repository: python docs/bench/epyc-avx512-bf16/one-row-products/whole-model.py [rounds] > .../whole-model.md
"""
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))
from bench.harness import bench_image, default_images_dir, default_model  # noqa: E402
from engine import EngineConfig  # noqa: E402
from engine.client import Engine  # noqa: E402
from engine.request import ChatRequest, Turn  # noqa: E402

ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 3
folder = Path(tempfile.mkdtemp())
picture = folder / "standard.png"
bench_image("448x448", default_images_dir()).save(picture)
question = "Describe this image."

engines, lines = {}, []
for name, mode in (("compiled (on)", "on"), ("float16 copy (auto)", "auto")):
    started = time.perf_counter()
    engines[name] = Engine(EngineConfig(model=default_model(), dtype="bfloat16", compute_dtype="bfloat16", compile=mode,
                                        warmup=False, threads=2, db_path=str(folder / f"{mode}.sqlite")))
    lines.append(f"- {name}: load {time.perf_counter() - started:.1f} s; {engines[name].info.decode}")

rows, texts = {name: [] for name in engines}, {}
for _ in range(ROUNDS):
    for name, engine in engines.items():
        first = engine.ask(ChatRequest(prompt=question, images=(picture,), max_new_tokens=64, ignore_eos=True))
        history = (Turn("user", question, (picture,)), Turn("assistant", first.text))
        follow_up = engine.ask(ChatRequest(prompt="And the colours?", history=history, max_new_tokens=8,
                                           ignore_eos=True))
        steps = sorted(first.metrics.token_latencies_s)
        m = first.metrics
        rows[name].append((m.ttft_s, m.decode_tokens_per_s, m.e2e_s, follow_up.metrics.ttft_s,
                           1000 * steps[len(steps) // 2], 1000 * steps[len(steps) // 10]))
        texts[name] = first.text

print(f"# bfloat16 decode: compiled against fbgemm's float16 copy, {ROUNDS} interleaved rounds\n")
print("\n".join(lines))
print(f"- the same greedy text: {len(set(texts.values())) == 1}\n")
print("| engine | round | TTFT s | decode tok/s | end to end s | follow-up TTFT s | step p50 ms | step p10 ms |")
print("|---|---|---|---|---|---|---|---|")
for name, runs in rows.items():
    for index, row in enumerate(runs + [tuple(statistics.median(column) for column in zip(*runs))]):
        label = "median" if index == len(runs) else str(index + 1)
        print(f"| {name} | {label} | " + " | ".join(f"{value:.2f}" for value in row) + " |")
