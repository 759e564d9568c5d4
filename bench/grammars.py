"""Grammar engines for structured answers, compared on this CPU with this model's tokenizer: how many schemas of a
set each one compiles (and refuses, by name), whether it accepts exactly the instances the set marks valid, its
compile time and its mask time. llguidance as vlscope runs it (engine/structured/), and XGrammar where it imports.

    python -m bench.grammars --suite JSON-Schema-Test-Suite/tests/draft2020-12 --out grammars.json

The suite is JSON-Schema-Test-Suite's folder of test files (each: a schema and instances marked valid or not).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from engine.config import EngineConfig
from engine.errors import InvalidSchema
from engine.request import ChatRequest
from fixtures.places import shared_dir

from .cli import machine_line, write_results


@dataclass
class Case:
    name: str
    schema: object
    instances: list[tuple[str, bool]]  # the instance as the model would write it, and whether it is valid


@dataclass
class EngineResult:
    engine: str
    schemas: int = 0
    compiled: int = 0
    instances: int = 0
    agreed: int = 0
    accepted_invalid: int = 0  # the engine would let an answer through that the schema forbids
    rejected_valid: int = 0  # stricter than the schema: an allowed answer it cannot write
    compile_ms: list[float] = field(default_factory=list)
    mask_ms: list[float] = field(default_factory=list)
    refusals: dict[str, int] = field(default_factory=dict)


def suite_cases(folder: Path) -> list[Case]:
    """Every test group of the suite's top-level files (not its optional ones), instances written as json.dumps does:
    one space after ':' and ','."""
    cases = []
    for path in sorted(folder.glob("*.json")):
        for group in json.loads(path.read_text()):
            cases.append(Case(f"{path.stem}: {group['description']}", group["schema"],
                              [(json.dumps(test["data"], ensure_ascii=False), bool(test["valid"]))
                               for test in group["tests"]]))
    return cases


class Llguidance:
    """vlscope's own path: the schema checked, compiled with its limits and style, matched token by token."""

    name = "llguidance"

    def __init__(self, tokenizer, vocab_size: int, eos_ids: tuple[int, ...]):
        from engine.structured.compiler import GrammarCompiler

        self.compiler = GrammarCompiler(tokenizer, vocab_size, eos_ids)
        self.compiler.tokenizer  # built once, outside the timings
        self.config = EngineConfig(grammar_cache_entries=1)
        self.bits = np.zeros((vocab_size + 31) // 32, dtype=np.int32)

    def compile(self, schema):
        try:
            return self.compiler.for_request(ChatRequest(prompt="", json_schema=json.dumps(schema)), self.config)
        except InvalidSchema as exc:
            raise ValueError(exc.kind) from None

    def matches(self, compiled, tokens: list[int], mask_ms: list[float]) -> bool:
        matcher = compiled.matcher.deep_copy()
        for token in tokens:
            started = time.perf_counter()
            matcher.unsafe_compute_mask_ptr(self.bits.ctypes.data, self.bits.nbytes)
            mask_ms.append(1000 * (time.perf_counter() - started))
            if not matcher.consume_token(token):
                return False
        return matcher.is_accepting()


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int, eos_ids: tuple[int, ...]):
        import xgrammar

        self.xgr = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=list(eos_ids))
        self.compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
        self.bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)

    def compile(self, schema):
        try:
            return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(", ", ": "))
        except Exception as exc:  # noqa: BLE001 - any failure to compile counts as a refusal, by its type
            raise ValueError(type(exc).__name__) from None

    def matches(self, compiled, tokens: list[int], mask_ms: list[float]) -> bool:
        matcher = self.xgr.GrammarMatcher(compiled)
        for token in tokens:
            started = time.perf_counter()
            matcher.fill_next_token_bitmask(self.bitmask)
            mask_ms.append(1000 * (time.perf_counter() - started))
            if not matcher.accept_token(token):
                return False
        return matcher.is_completed()


def measure(engine, cases: list[Case], tokenizer) -> EngineResult:
    result = EngineResult(engine.name)
    for case in cases:
        result.schemas += 1
        started = time.perf_counter()
        try:
            compiled = engine.compile(case.schema)
        except ValueError as exc:
            result.refusals[str(exc)] = result.refusals.get(str(exc), 0) + 1
            continue
        result.compile_ms.append(1000 * (time.perf_counter() - started))
        result.compiled += 1
        for text, valid in case.instances:
            accepted = engine.matches(compiled, tokenizer.encode(text, add_special_tokens=False), result.mask_ms)
            result.instances += 1
            result.agreed += accepted == valid
            result.accepted_invalid += accepted and not valid
            result.rejected_valid += valid and not accepted
    return result


def markdown(results: list[EngineResult], suite: str) -> str:
    lines = [f"Schemas: {suite}", "",
             "| engine | schemas compiled | refused (by kind) | instances agreeing with the suite | accepted invalid | "
             "rejected valid | compile ms median / max | mask ms median / p99 |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        refused = ", ".join(f"{kind} {n}" for kind, n in sorted(r.refusals.items(), key=lambda kv: -kv[1]))
        compile_ms = f"{statistics.median(r.compile_ms):.2f} / {max(r.compile_ms):.1f}" if r.compile_ms else "–"
        mask = (f"{statistics.median(r.mask_ms):.4f} / {np.percentile(r.mask_ms, 99):.3f}" if r.mask_ms else "–")
        lines.append(f"| {r.engine} | {r.compiled} of {r.schemas} ({r.compiled / max(r.schemas, 1):.0%}) | "
                     f"{refused or '–'} | {r.agreed} of {r.instances} ({r.agreed / max(r.instances, 1):.1%}) | "
                     f"{r.accepted_invalid} | {r.rejected_valid} | {compile_ms} | {mask} |")
    return "\n".join(lines)


def model_tokenizer(model: str) -> tuple[object, int, tuple[int, ...]]:
    """A model folder's tokenizer, its vocabulary size (the model's, padding included) and its end tokens."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    config = json.loads((Path(model) / "config.json").read_text())
    vocab = int(config.get("text_config", config).get("vocab_size", len(tokenizer)))
    return tokenizer, vocab, tuple(tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.grammars", description=__doc__.split("\n\n")[0])
    parser.add_argument("--suite", required=True, help="a folder of JSON-Schema-Test-Suite test files")
    parser.add_argument("--model", default=str(shared_dir() / "qwen3-vl-2b"), help="whose tokenizer to use")
    parser.add_argument("--out", help="write the results here as JSON, and a markdown table beside it")
    args = parser.parse_args(argv)
    tokenizer, vocab, eos = model_tokenizer(args.model)
    cases = suite_cases(Path(args.suite))
    results = []
    for engine_class in (Llguidance, Xgrammar):
        try:
            engine = engine_class(tokenizer, vocab, eos)
        except ImportError as exc:
            print(f"{engine_class.name}: not installed here ({exc})", file=sys.stderr)
            continue
        results.append(measure(engine, cases, tokenizer))
    text = f"{machine_line()}\n\n{markdown(results, f'{len(cases)} schemas of {args.suite}')}\n"
    print(text)
    if args.out:
        write_results(args.out, [summary(result) for result in results], text)
    return 0


def summary(result: EngineResult) -> dict:
    """The result as it is kept: its timings as percentiles, not every one of them."""
    kept = asdict(result)
    for name in ("compile_ms", "mask_ms"):
        values = kept.pop(name)
        kept[name] = {f"p{p}": float(np.percentile(values, p)) for p in (50, 90, 99, 100)} if values else {}
    return kept


if __name__ == "__main__":
    sys.exit(main())
