"""Products over Qwen3-VL-2B's language-model shapes (28 layers, q/k/v and gate/up stacked, plus the LM head),
2 threads, one process, kernels interleaved round by round. Decode is one row per product: what matters is the
weight bytes read per second. Prefill is many rows: what matters is GFLOP/s.

Run: python docs/bench/epyc-avx512-bf16/one-row-products/products.py > docs/bench/epyc-avx512-bf16/one-row-products/products.md
"""
import statistics
import subprocess
import time

import warnings

import torch

torch.set_num_threads(2)
warnings.filterwarnings("ignore", message=".*quantize_per.*deprecated")  # the int8 row is a reference only
torch.backends.quantized.engine = "fbgemm"
HIDDEN, INTERMEDIATE, LAYERS, VOCAB = 2048, 6144, 28, 151936
SHAPES = [(2048 + 1024 + 1024, HIDDEN), (HIDDEN, 2048), (2 * INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)] * LAYERS
SHAPES += [(VOCAB, HIDDEN)]
ROUNDS, PREFILL_ROWS = 8, 256

generator = torch.Generator().manual_seed(0)
fp16, bf16, int8 = [], [], []
for out_features, in_features in SHAPES:
    weight = (torch.randn(out_features, in_features, generator=generator) * 0.02).bfloat16().float()
    fp16.append(torch.ops.quantized.linear_prepack_fp16(weight, None))
    bf16.append(torch.ops.mkldnn._reorder_linear_weight(weight.bfloat16(), 1))
    scales = (weight.abs().amax(1) / 127).double()
    quantized = torch.quantize_per_channel(weight, scales, torch.zeros(out_features, dtype=torch.long), 0, torch.qint8)
    int8.append(torch.ops.quantized.linear_prepack(quantized, None))
elements = sum(o * i for o, i in SHAPES)


def products(kind, rows):
    inputs = {i: torch.randn(rows, i) for _, i in SHAPES}
    if kind == "bf16 oneDNN packed":
        inputs = {i: x.bfloat16() for i, x in inputs.items()}
        return lambda: [torch.ops.mkldnn._linear_pointwise(inputs[i], p, None, "none", [], "")
                        for (_, i), p in zip(SHAPES, bf16)]
    if kind == "fp16 fbgemm":
        return lambda: [torch.ops.quantized.linear_dynamic_fp16(inputs[i], p) for (_, i), p in zip(SHAPES, fp16)]
    return lambda: [torch.ops.quantized.linear_dynamic(inputs[i], p, False) for (_, i), p in zip(SHAPES, int8)]


def timed(runs):
    times = {name: [] for name in runs}
    with torch.inference_mode():
        for _ in range(ROUNDS):
            for name, run in runs.items():
                started = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - started)
    return {name: sorted(t[2:]) for name, t in times.items()}  # the first two rounds warm caches and pages


cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
flags = [f for f in ("avx512_bf16", "avx512_vnni", "amx_tile", "avx2") if f in cpu]
model = next((line.split(":", 1)[1].strip() for line in cpu.splitlines() if line.startswith("Model name")), "cpu")
print(f"# {model}; {', '.join(flags)}; torch {torch.__version__}; 2 threads")
print(f"# weights: {elements * 2 / 1e9:.2f} GB in 16 bits, {elements / 1e9:.2f} GB in int8, a token")

big = torch.ones(2**29)
one_row = timed({"fp16 fbgemm": products("fp16 fbgemm", 1), "bf16 oneDNN packed": products("bf16 oneDNN packed", 1),
                 "int8 fbgemm dynamic": products("int8", 1), "sum of 2 GiB float32": big.sum})
print("\n## one row (decode)\n\n| kernel | ms p50 | ms min | GB/s at p50 | GB/s at min |\n|---|---|---|---|---|")
for name, t in one_row.items():
    nbytes = 4 * 2**29 if name.startswith("sum") else elements * (1 if name.startswith("int8") else 2)
    p50, best = statistics.median(t), t[0]
    print(f"| {name} | {1000 * p50:.1f} | {1000 * best:.1f} | {nbytes / p50 / 1e9:.1f} | {nbytes / best / 1e9:.1f} |")
del big

# Prefill: the first 8 layers are enough to rank the kernels (the LM head runs one row at the end of prefill).
SHAPES = SHAPES[:32]
many = timed({"fp16 fbgemm": products("fp16 fbgemm", PREFILL_ROWS),
              "bf16 oneDNN packed": products("bf16 oneDNN packed", PREFILL_ROWS)})
flops = sum(2 * PREFILL_ROWS * o * i for o, i in SHAPES)
print(f"\n## {PREFILL_ROWS} rows (prefill), 8 layers\n\n| kernel | ms p50 | GFLOP/s at p50 |\n|---|---|---|")
for name, t in many.items():
    print(f"| {name} | {1000 * statistics.median(t):.1f} | {flops / statistics.median(t) / 1e9:.0f} |")

weight = (torch.randn(2048, 2048, generator=generator) * 0.02).bfloat16().float()
x = torch.randn(1, 2048, generator=generator)
error = (torch.ops.quantized.linear_dynamic_fp16(x, torch.ops.quantized.linear_prepack_fp16(weight, None))
         - x @ weight.t()).abs().max().item()
print(f"\nfp16 product on bfloat16-exact weights, max abs error against float32: {error:.1e}")
