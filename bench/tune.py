"""`python -m bench.tune`: the implementation choices behind the tuned path, each measured on this CPU.

Three questions, each answered on the full-size model with one real image through the engine's own stages:
- attention implementation: PyTorch's fused scaled_dot_product_attention ("sdpa") or transformers' "eager" one,
  for the vision tower, prefill and decode;
- KV cache: a DynamicCache that grows per token, or a StaticCache allocated once for the whole answer;
- torch.compile of the language model (with the static cache, the combination it is meant for).
Each option must give the same greedy tokens as the default before its time counts. The engine keeps whichever
wins; docs/decisions.md holds the figures the current choice rests on.
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import DynamicCache, StaticCache

from engine.config import DTYPES, EngineConfig
from engine.core.sampling import sample
from engine.inputs.limits import fit_to_budget
from engine.inputs.preprocess import single_image_inputs
from engine.model.generate import decode_one_token, encode_images, prefill
from engine.model.loading import LoadedModel, load_model
from speed.plan import PROMPT

from .cli import fail
from .harness import default_images_dir, default_model

GREEDY = (0.0, 1.0, torch.Generator())


@dataclass(frozen=True)
class Trial:
    choice: str
    option: str
    vision_s: float | None
    prefill_s: float
    decode_ms_per_token: float
    tokens: tuple[int, ...]
    setup_s: float = 0.0  # compilation, where there is one


def _inputs(loaded: LoadedModel, image_path: Path, side: int):
    from PIL import Image

    image = Image.open(image_path).convert("RGB").resize((side, side))
    resized = fit_to_budget(*image.size, 64 * 1024, 1024 * 1024)
    return single_image_inputs(loaded, image, resized, PROMPT)


def run_once(loaded: LoadedModel, prompt, patches, new_tokens: int, cache_factory, vision=None):
    """Vision (unless given), prefill and `new_tokens` greedy decode steps, timed at the stage boundaries."""
    model = loaded.model
    with torch.inference_mode():
        started = time.perf_counter()
        if vision is None:
            vision = encode_images(model, patches)
        vision_s = time.perf_counter() - started
        started = time.perf_counter()
        logits, state = prefill(model, prompt, vision, patches.image_grid_thw, True, cache=cache_factory())
        token = sample(logits, *GREEDY)
        prefill_s = time.perf_counter() - started
        tokens = [token]
        started = time.perf_counter()
        for _ in range(new_tokens - 1):
            token = sample(decode_one_token(model, state, token), *GREEDY)
            tokens.append(token)
        decode_s = time.perf_counter() - started
    return vision, vision_s, prefill_s, decode_s / max(1, new_tokens - 1) * 1000, tuple(tokens)


def best_of(loaded, prompt, patches, new_tokens, cache_factory, repeats, choice, option, reuse_vision=None,
            setup_s=0.0) -> Trial:
    runs = [run_once(loaded, prompt, patches, new_tokens, cache_factory, reuse_vision) for _ in range(repeats)]
    return Trial(choice, option, None if reuse_vision is not None else min(r[1] for r in runs),
                 min(r[2] for r in runs), min(r[3] for r in runs), runs[0][4], setup_s)


def tune(config: EngineConfig, image_path: Path, new_tokens: int = 32, repeats: int = 2, side: int = 448,
         compile_: bool = True, report=print) -> list[Trial]:
    loaded = load_model(config)
    model = loaded.model
    prompt, patches = _inputs(loaded, image_path, side)
    text_config = model.config.get_text_config()
    length = prompt.input_ids.shape[1] + new_tokens

    def dynamic():
        return DynamicCache(config=text_config)

    def static():
        return StaticCache(config=text_config, max_cache_len=length)

    trials: list[Trial] = []
    report(f"model {config.model} ({config.dtype}, {loaded.compute_dtype} compute), {config.threads} threads, "
           f"{prompt.input_ids.shape[1]} prompt tokens, {new_tokens} new tokens, best of {repeats}")
    run_once(loaded, prompt, patches, 2, dynamic)  # warm-up: first-touch costs belong to no option
    for implementation in ("sdpa", "eager"):
        model.set_attn_implementation(implementation)
        trials.append(best_of(loaded, prompt, patches, new_tokens, dynamic, repeats, "attention", implementation))
        report(_line(trials[-1]))
    model.set_attn_implementation("sdpa")
    vision = encode_images(model, patches)
    for name, factory in (("dynamic", dynamic), ("static", static)):
        trials.append(best_of(loaded, prompt, patches, new_tokens, factory, repeats, "kv cache", name, vision))
        report(_line(trials[-1]))
    if compile_:
        language_model = model.model.language_model
        eager_forward = language_model.forward
        language_model.forward = torch.compile(eager_forward, dynamic=False)
        started = time.perf_counter()
        try:
            run_once(loaded, prompt, patches, 3, static, vision)  # compiles prefill and the decode step
            setup_s = time.perf_counter() - started
            trials.append(best_of(loaded, prompt, patches, new_tokens, static, repeats, "torch.compile",
                                  "static cache, compiled", vision, setup_s))
            report(_line(trials[-1]))
        except Exception as exc:  # a compiler failure is a measured outcome here, not a crash of the run
            report(f"torch.compile: failed after {time.perf_counter() - started:.0f} s: {type(exc).__name__}: "
                   f"{str(exc).splitlines()[0] if str(exc) else ''}")
        finally:
            language_model.forward = eager_forward
    return trials


def _line(trial: Trial) -> str:
    vision = "" if trial.vision_s is None else f"vision {trial.vision_s:.2f} s, "
    setup = f", compile {trial.setup_s:.0f} s" if trial.setup_s else ""
    return (f"{trial.choice}: {trial.option}: {vision}prefill {trial.prefill_s:.2f} s, "
            f"decode {trial.decode_ms_per_token:.0f} ms/token{setup}")


def markdown(trials: list[Trial], header: str) -> str:
    default_tokens = trials[0].tokens if trials else ()
    lines = [header, "", "| choice | option | vision s | prefill s | decode ms/token | setup s | same tokens |",
             "|---|---|---|---|---|---|---|"]
    for trial in trials:
        lines.append(f"| {trial.choice} | {trial.option} | "
                     f"{'–' if trial.vision_s is None else f'{trial.vision_s:.2f}'} | {trial.prefill_s:.2f} | "
                     f"{trial.decode_ms_per_token:.0f} | {trial.setup_s:.0f} | "
                     f"{'yes' if trial.tokens == default_tokens else 'NO'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.tune",
                                     description="measure attention implementation, cache kind and torch.compile")
    parser.add_argument("--model", help="default: as for python -m bench")
    parser.add_argument("--dtype", choices=DTYPES, default="float32")
    parser.add_argument("--threads", type=int)
    parser.add_argument("--image", help="default: coffee.png from the images folder the benchmark uses")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--out", help="also write the table here (markdown)")
    args = parser.parse_args(argv)
    try:
        config = EngineConfig(model=args.model or default_model(), dtype=args.dtype, threads=args.threads or
                              EngineConfig().threads, warmup=False)
    except ValueError as exc:
        return fail(exc)
    lines: list[str] = []

    def report(line: str) -> None:
        lines.append(line)
        print(line, flush=True)

    image = Path(args.image) if args.image else default_images_dir() / "coffee.png"
    trials = tune(config, image, new_tokens=args.new_tokens, repeats=args.repeats,
                  compile_=not args.no_compile, report=report)
    table = markdown(trials, "# Implementation choices measured by `python -m bench.tune`\n\n" + lines[0])
    print(table)
    if args.out:
        Path(args.out).write_text(table + "\n" + "\n".join(f"    {line}" for line in lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
