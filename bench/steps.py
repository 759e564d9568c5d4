"""`python -m bench.steps`: a decode step for several answers against a step for one, at the same cached length.

Batched decode pays off by what one step for B sequences costs against a step for one: the products read every
weight once for all rows, attention reads each sequence's own keys and values. bench.load reports steps by batch size
over a burst, where steps of one run early (short sequences) and steps of four later (longer ones); here both run at
the same lengths, interleaved one, B, one, B, through the engine's own decode step, on keys and values filled with
noise (attention costs the same whatever their values).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import torch
from transformers import DynamicCache

from engine.client import Engine
from engine.config import DTYPES, EngineConfig
from engine.core import compute
from engine.model.generate import next_positions

from .cli import machine_line, write_results
from .harness import default_model


@dataclass(frozen=True)
class StepTimes:
    length: int  # cached positions each sequence attends over
    batch: int
    one_ms: float  # median step for one sequence
    batch_ms: float  # median step for `batch` sequences

    @property
    def gain(self) -> float:
        """Tokens per second of the batched step against the single one's."""
        return self.batch * self.one_ms / self.batch_ms


def _sequence(step, config, length: int):
    """A sequence's buffers holding `length` positions of noise, as the step takes a prefilled cache."""
    cache = DynamicCache(config=config)
    shape = (1, step.kv_heads, length, step.head_dim)
    for index in range(len(step.layers)):
        cache.update(torch.randn(shape, dtype=step.cache_dtype), torch.randn(shape, dtype=step.cache_dtype), index)
    return step.take(cache)


def _median_step_ms(step, config, length: int, rows: int, steps: int) -> float:
    kvs = [_sequence(step, config, length) for _ in range(rows)]
    times = []
    for _ in range(steps):
        positions = torch.cat([next_positions(kv.length, 0) for kv in kvs], dim=2)
        tokens = torch.randint(0, 1000, (rows,))
        started = time.perf_counter()
        step.batch(kvs, tokens, positions)
        times.append(time.perf_counter() - started)
        for kv in kvs:
            kv.length = length  # every step at the same length
    return 1000 * statistics.median(times[1:])


def measure(engine: Engine, lengths: list[int], batch: int, steps: int = 12, rounds: int = 3) -> list[StepTimes]:
    """For each length, `rounds` pairs of (one sequence, `batch` sequences), interleaved; medians over the rounds."""
    step = engine.decode_step
    if step is None:
        raise SystemExit("this engine decodes through transformers' forward, one sequence at a time: nothing to batch")
    config = engine.loaded.model.config.get_text_config()

    def run() -> list[StepTimes]:
        results = []
        with torch.inference_mode():
            for length in lengths:
                one, many = [], []
                for _ in range(rounds):
                    one.append(_median_step_ms(step, config, length, 1, steps))
                    many.append(_median_step_ms(step, config, length, batch, steps))
                results.append(StepTimes(length, batch, statistics.median(one), statistics.median(many)))
        return results

    return compute.run(run)


def markdown(results: list[StepTimes]) -> str:
    lines = ["| cached tokens | one sequence ms | sequences | batched step ms | tokens/s against one |",
             "|---|---|---|---|---|"]
    lines += [f"| {r.length} | {r.one_ms:.1f} | {r.batch} | {r.batch_ms:.1f} | {r.gain:.2f}x |" for r in results]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.steps", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: as for python -m bench")
    parser.add_argument("--dtype", default="int8", choices=DTYPES)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 512])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", help="write the results here as JSON, and a markdown table beside it")
    args = parser.parse_args(argv)
    config = EngineConfig.from_env().replace(model=args.model or default_model(), dtype=args.dtype, warmup=False,
                                             db_path=":memory:")
    engine = Engine(config)
    try:
        results = measure(engine, args.lengths, args.batch, args.steps, args.rounds)
    finally:
        engine.close()
    text = f"{machine_line()}; vlscope {args.dtype}, {engine.info.decode}\n\n{markdown(results)}\n"
    print(text)
    if args.out:
        write_results(args.out, [asdict(r) | {"gain": r.gain} for r in results], text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
