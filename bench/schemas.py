"""Which real-world JSON Schemas vlscope takes as a response format, with `strict` and without: a sample of every
category of a schema set laid out as JSONSchemaBench's (a folder per category, one schema per file), each compiled as
a request's would be (the same checks, limits and grammar), refusals counted by kind.

    python -m bench.schemas --set jsonschemabench/data --per-category 30 --out schemas.json

Without `strict` a schema is held to the closest grammar; "loosened" counts those whose grammar leaves a keyword
out (their finished answers are checked against the whole schema and flagged when they break it).
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from engine.config import EngineConfig
from engine.errors import InvalidSchema
from engine.request import ChatRequest
from engine.structured.compiler import GrammarCompiler

from .cli import machine_line, write_results
from .grammars import model_tokenizer


@dataclass
class Category:
    name: str
    schemas: int = 0
    strict: int = 0  # accepted with strict: true
    lenient: int = 0  # accepted without strict
    loosened: int = 0  # of those, held with a keyword left out of the grammar
    refusals: dict[str, int] = field(default_factory=dict)  # without strict, by kind
    compile_ms: list[float] = field(default_factory=list)


def sample(folder: Path, per_category: int) -> dict[str, list[Path]]:
    """Up to `per_category` files of each category, spread evenly over its sorted names (the same every run)."""
    chosen = {}
    for category in sorted(path for path in folder.iterdir() if path.is_dir()):
        files = sorted(category.glob("*.json"))
        step = max(len(files) / per_category, 1.0)
        chosen[category.name] = [files[int(index * step)] for index in range(min(per_category, len(files)))]
    return chosen


def measure(compiler: GrammarCompiler, config: EngineConfig, files: dict[str, list[Path]]) -> list[Category]:
    results = []
    for name, paths in files.items():
        result = Category(name)
        for path in paths:
            text = path.read_text(encoding="utf-8", errors="replace")
            result.schemas += 1
            for strict in (True, False):
                started = time.perf_counter()
                try:
                    compiled = compiler.for_request(ChatRequest(prompt="", json_schema=text, strict=strict), config)
                except InvalidSchema as exc:
                    if not strict:
                        result.refusals[exc.kind] = result.refusals.get(exc.kind, 0) + 1
                    continue
                if strict:
                    result.strict += 1
                else:
                    result.compile_ms.append(1000 * (time.perf_counter() - started))
                    result.lenient += 1
                    result.loosened += bool(compiled.loosened)
        results.append(result)
    return results


def markdown(results: list[Category], source: str) -> str:
    def share(part: int, whole: int) -> str:
        return f"{part} ({part / max(whole, 1):.0%})"

    lines = [f"Schemas: {source}", "",
             "| category | schemas | accepted, strict | accepted, not strict | of those loosened | refused without "
             "strict (by kind) | compile ms median |", "|---|---|---|---|---|---|---|"]
    total = Category("all", compile_ms=[ms for r in results for ms in r.compile_ms])
    for r in results:
        total.schemas, total.strict, total.lenient = (total.schemas + r.schemas, total.strict + r.strict,
                                                      total.lenient + r.lenient)
        total.loosened += r.loosened
        for kind, n in r.refusals.items():
            total.refusals[kind] = total.refusals.get(kind, 0) + n
    for r in [*results, total]:
        refused = ", ".join(f"{kind} {n}" for kind, n in sorted(r.refusals.items(), key=lambda kv: -kv[1]))
        median = f"{statistics.median(r.compile_ms):.1f}" if r.compile_ms else "–"
        name = f"**{r.name}**" if r is total else r.name
        lines.append(f"| {name} | {r.schemas} | {share(r.strict, r.schemas)} | {share(r.lenient, r.schemas)} | "
                     f"{r.loosened} | {refused or '–'} | {median} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from engine import SKELETON_DIR

    parser = argparse.ArgumentParser(prog="python -m bench.schemas", description=__doc__.split("\n\n")[0])
    parser.add_argument("--set", required=True, help="a folder with a folder of schema files per category")
    parser.add_argument("--per-category", type=int, default=30, help="schemas taken from each category")
    parser.add_argument("--model", default=str(SKELETON_DIR), help="whose tokenizer to use")
    parser.add_argument("--out", help="write the results here as JSON, and a markdown table beside it")
    args = parser.parse_args(argv)
    compiler = GrammarCompiler(*model_tokenizer(args.model))
    try:
        # The server's limits (VLSCOPE_MAX_SCHEMA_BYTES and the rest, from the environment), with no cache between.
        config = dataclasses.replace(EngineConfig.from_env(), grammar_cache_entries=1)
        results = measure(compiler, config, sample(Path(args.set), args.per_category))
    finally:
        compiler.close()
    source = f"{args.per_category} per category of {args.set}, schemas up to {config.max_schema_bytes:,} bytes"
    text = f"{machine_line()}\n\n{markdown(results, source)}\n"
    print(text)
    if args.out:
        write_results(args.out, [asdict(r) | {"compile_ms": None} for r in results], text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
