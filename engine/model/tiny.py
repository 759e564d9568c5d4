"""A tiny Qwen3-VL of the same family, written to disk for tests: it loads through the same from_pretrained path as
the real model, in seconds."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from .loading import SKELETON_FILES, build_synthetic

TINY_TEXT = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
)
TINY_VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=32)


def make_tiny(skeleton: str | Path, outdir: str | Path, seed: int = 0) -> Path:
    """Write a tiny Qwen3-VL of the same family (same tokenizer, small dimensions, real weight files) for tests.

    It has weight files, so loading it goes through the same from_pretrained path as the real model.
    """
    skeleton, outdir = Path(skeleton), Path(outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    for name in SKELETON_FILES:
        if (skeleton / name).is_file():
            shutil.copyfile(skeleton / name, outdir / name)
    raw = json.loads((skeleton / "config.json").read_text())
    raw["text_config"].update(TINY_TEXT)
    # The rotary sections must add up to head_dim / 2.
    raw["text_config"]["rope_parameters"]["mrope_section"] = [4, 2, 2]
    raw["vision_config"].update(TINY_VISION)
    raw["vision_config"]["deepstack_visual_indexes"] = [0]
    (outdir / "config.json").write_text(json.dumps(raw, indent=2))
    # Wider weights than the full-size synthetic model's, so the tiny model's logits are not all alike.
    build_synthetic(outdir, torch.bfloat16, seed=seed, std=0.2).save_pretrained(outdir)
    (outdir / "README.md").write_text(
        "# Tiny Qwen3-VL for tests\n\nMade by `python -m engine make-tiny` from the Qwen3-VL-2B-Instruct skeleton: "
        "the real tokenizer, chat template and preprocessing, with tiny dimensions and random weights. "
        "Its answers are noise. Apache-2.0 (Qwen team, Alibaba Cloud) for the tokenizer and template files.\n"
    )
    return outdir
