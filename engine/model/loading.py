"""Loading Qwen3-VL once: real weights through from_pretrained, or the real architecture with synthetic weights.

A folder with config and tokenizer but no weight files gives the synthetic model: answers are noise, but every
tensor has its real shape, so latency and memory are what the real model costs.
"""
from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable
from urllib.parse import urlparse

import torch
from torch import nn
from transformers import AutoConfig, AutoTokenizer, GenerationConfig, Qwen3VLForConditionalGeneration
from transformers.initialization import no_init_weights
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from ..kernels import attention
from ..config import INTEGER_DTYPES, EngineConfig, looks_like_hub_id
from ..errors import ModelUnavailable
from ..kernels.fusion import stack_projections_
from ..kernels.packing import pack_remaining_linears
from .memory_pages import release_freed_memory
from ..kernels.int4 import best as best_int4
from ..kernels.quantize import (INT8_WITHOUT_VNNI, LINEAR_KINDS, compute_in_float32_, has_int8_dot_product, linear_weight_bytes,
                       int8_vision_is_faster, quantize_int4_, quantize_int8_, quantize_vision_int8_)
from ..machine import bfloat16_matmul_is_faster

log = logging.getLogger(__name__)

ProgressCallback = Callable[[float, str], None]  # (fraction done 0..1, what is happening)

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
SKELETON_FILES = (
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "preprocessor_config.json",
    "generation_config.json",
)


@dataclass
class LoadedModel:
    model: nn.Module
    tokenizer: object
    image_processor: object
    eos_token_ids: tuple[int, ...]
    image_token_id: int
    video_token_id: int
    name: str
    synthetic: bool
    dtype: str  # how the weights are stored: float32, bfloat16, int8 or int4
    compute_dtype: str  # what activations, attention and the KV cache are in: float32 or bfloat16
    weight_bytes: int
    load_seconds: float
    decode_weight_bytes: int = 0  # bytes of weights one decode step reads: the language model's Linears and head
    draft_bytes: int = 0  # the int8 copy that drafts tokens for float32 (model/draft.py), within weight_bytes
    notes: tuple[str, ...] = ()  # kernels this CPU cannot serve and what runs instead, one line each

    @property
    def vocab_size(self) -> int:
        """Columns of the logits: the tokenizer's tokens and the head's padding past them."""
        return int(self.model.config.get_text_config().vocab_size)


def has_weights(folder: Path) -> bool:
    return any(p.suffix in WEIGHT_SUFFIXES for p in folder.iterdir() if p.is_file())


def _torch_dtype(dtype: str) -> torch.dtype:
    # int8 and int4 swap the language model's weights into a bfloat16 model; the rest of its weights stay bfloat16.
    return torch.float32 if dtype == "float32" else torch.bfloat16


def resolve_compute_dtype(config: EngineConfig) -> str:
    """float32 weights compute in float32; compact ones in bfloat16 only where this CPU runs it faster."""
    if config.dtype == "float32":
        return "float32"
    if config.compute_dtype != "auto":
        return config.compute_dtype
    return "bfloat16" if bfloat16_matmul_is_faster(config.threads) else "float32"


def weight_bytes(model: nn.Module) -> int:
    """Bytes of parameters and buffers (int8 weights and their scales included), tied tensors counted once, plus
    the weights kernels hold packed in their own layouts."""
    seen: set[int] = set()
    total = sum(getattr(module, "packed_nbytes", 0) for module in model.modules())
    for tensor in list(model.parameters()) + list(model.buffers()):
        if tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        total += tensor.numel() * tensor.element_size()
    return total


def decode_weight_bytes(model: nn.Module) -> int:
    """Bytes a decode step reads: every Linear of the language model plus the LM head (the vision tower is idle,
    the embeddings give one row). Decode is bound by this over the memory's read rate."""
    modules = list(model.model.language_model.modules()) + [model.lm_head]
    return sum(linear_weight_bytes(module) for module in modules if isinstance(module, LINEAR_KINDS))


def fill_synthetic_(model: nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Give every parameter plausible values fast: norms 1, biases 0, matrices a tiled random pool.

    Tiling one random pool costs one memory copy per tensor instead of 2 billion random draws, so 2B parameters
    are ready in seconds. Values are never left uninitialised: garbage memory can hold denormals or NaNs that
    change speed.
    """
    generator = torch.Generator().manual_seed(seed)
    pool_size = (1 << 16) + 7  # odd length, so tiled rows do not line up exactly
    pools: dict[torch.dtype, torch.Tensor] = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if "norm" in name and param.dim() == 1:
                param.fill_(1.0 if leaf == "weight" else 0.0)
            elif leaf == "bias":
                param.zero_()
            else:
                pool = pools.get(param.dtype)
                if pool is None:
                    pool = (torch.randn(pool_size, generator=generator) * std).to(param.dtype)
                    pools[param.dtype] = pool
                flat = param.view(-1)
                whole = flat.numel() // pool_size
                if whole:  # one multi-threaded copy for the bulk of the tensor
                    flat[: whole * pool_size].view(whole, pool_size).copy_(pool.expand(whole, pool_size))
                rest = flat.numel() - whole * pool_size
                if rest:
                    flat[whole * pool_size:].copy_(pool[:rest])


def _load_tokenizer_and_processor(source: str, local_only: bool):
    tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=local_only)
    # The PIL image processor does what AutoProcessor's does without needing torchvision.
    image_processor = Qwen2VLImageProcessorPil.from_pretrained(source, local_files_only=local_only)
    return tokenizer, image_processor


def hub_reachable(timeout_s: float = 3.0) -> bool:
    """One quick connection attempt, so an offline machine learns it in seconds, not after a minute of retries."""
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        return False
    parsed = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        socket.create_connection((parsed.hostname, port), timeout=timeout_s).close()
        return True
    except OSError:
        return False


def _eos_ids(source: str, tokenizer) -> tuple[int, ...]:
    ids: list[int] = []
    try:
        eos = GenerationConfig.from_pretrained(source).eos_token_id
        ids = list(eos) if isinstance(eos, (list, tuple)) else [eos] if eos is not None else []
    except OSError:
        pass
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return tuple(ids)


def _unavailable(model: str, cause: BaseException) -> ModelUnavailable:
    reason = (str(cause).splitlines()[0] if str(cause) else type(cause).__name__).rstrip(".")
    return ModelUnavailable(
        f"Could not load model {model!r} ({reason}). "
        "Its weights are not on this machine and the model hub could not be reached. Either pass a local folder "
        "that holds the weights (--model /path/to/Qwen3-VL-2B-Instruct, or VLSCOPE_MODEL), set HF_HUB_OFFLINE=1 "
        "if the model is already in the Hugging Face cache, or use the synthetic skeleton "
        "(--model models/qwen3-vl-2b-skeleton) to measure cost with random weights.",
        cause=f"its weights are not on this machine and the model hub could not be reached ({reason})",
    )


def build_synthetic(config_source: str | Path, dtype: torch.dtype, seed: int = 0, std: float = 0.02) -> nn.Module:
    """The architecture from config.json with synthetic weights, allocated once in its final dtype."""

    model_config = AutoConfig.from_pretrained(config_source)
    # Skipping transformers' per-module init is what makes 2B parameters ready in seconds instead of ~40 s.
    with no_init_weights():
        model = Qwen3VLForConditionalGeneration._from_config(model_config, dtype=dtype)
    # no_init_weights also skips the tying of the LM head to the embeddings; the real model is tied.
    model.tie_weights()
    fill_synthetic_(model, seed=seed, std=std)
    return model


def load_model(config: EngineConfig, progress: ProgressCallback | None = None) -> LoadedModel:
    """Load the model named by config.model: a hub id, a folder with weights, or a weightless skeleton folder."""
    report = progress or (lambda fraction, message: None)
    started = time.perf_counter()
    torch.set_num_threads(config.threads)
    attention.install()
    load_from, synthetic, local_only = _locate(config.model)
    report(0.05, "Loading tokenizer and image processor")
    try:
        tokenizer, image_processor = _load_tokenizer_and_processor(load_from, local_only)
    except (OSError, ValueError) as exc:
        raise _unavailable(config.model, exc) from None
    model = _read_weights(config, load_from, synthetic, local_only, report)
    compute_dtype, notes = _convert(model, config, report)
    release_freed_memory()
    report(0.95, "Model ready")
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        image_processor=image_processor,
        eos_token_ids=_eos_ids(load_from, tokenizer),
        image_token_id=int(model.config.image_token_id),
        video_token_id=int(model.config.video_token_id),
        name=config.model,
        synthetic=synthetic,
        dtype=config.dtype,
        compute_dtype=compute_dtype,
        weight_bytes=weight_bytes(model),
        load_seconds=time.perf_counter() - started,
        decode_weight_bytes=decode_weight_bytes(model),
        notes=tuple(notes),
    )


def _locate(source: str) -> tuple[str, bool, bool]:
    """Where the model loads from, whether its weights are synthetic (a folder without weight files), and whether
    only the local Hugging Face cache may serve it (a hub id while the hub is out of reach)."""
    folder = Path(source).expanduser()
    is_folder = folder.is_dir()
    if not is_folder and not looks_like_hub_id(source):
        raise ModelUnavailable(f"Model folder {source!r} does not exist. Pass a folder with config.json, or a hub id.")
    if is_folder and not (folder / "config.json").is_file():
        raise ModelUnavailable(f"{source!r} has no config.json: it is not a Qwen3-VL model folder.")
    return (str(folder) if is_folder else source), is_folder and not has_weights(folder), \
        not is_folder and not hub_reachable()


def _read_weights(config: EngineConfig, load_from: str, synthetic: bool, local_only: bool, report) -> nn.Module:
    torch_dtype = _torch_dtype(config.dtype)
    if synthetic:
        report(0.15, f"Building the architecture with synthetic weights ({config.dtype})")
        model = build_synthetic(load_from, torch_dtype, seed=config.seed)
    else:
        report(0.15, f"Loading weights ({config.dtype}); a first download can take minutes")
        try:
            model = Qwen3VLForConditionalGeneration.from_pretrained(load_from, dtype=torch_dtype,
                                                                    local_files_only=local_only)
        except (OSError, ValueError) as exc:
            raise _unavailable(config.model, exc) from None
    model.eval()
    model.requires_grad_(False)
    return model


def _convert(model: nn.Module, config: EngineConfig, report) -> tuple[str, list[str]]:
    """The weights as the engine computes with them: projections stacked, int8 quantized, compact weights widened
    where this CPU computes faster in float32, the vision tower packed. Returns the compute dtype and the notes
    of kernels this CPU cannot serve."""
    stack_projections_(model)
    if config.dtype == "int8":
        report(0.8, "Quantizing the language model's Linear layers to int8")
        quantize_int8_(model)
    elif config.dtype == "int4":
        kernel, why = best_int4()
        if kernel is None:  # no other kernel reads these weights: refuse the load rather than fall back silently
            raise ModelUnavailable(f"{why}. int4 needs it; int8 runs without it.")
        report(0.8, "Quantizing the language model's Linear layers to 4 bits")
        quantize_int4_(model)
    compute_dtype = resolve_compute_dtype(config)
    if config.dtype in INTEGER_DTYPES and has_int8_dot_product() and int8_vision_is_faster(config.threads,
                                                                                            compute_dtype):
        report(0.85, "Quantizing the vision tower's Linear layers to int8 (faster than its matmuls here)")
        quantize_vision_int8_(model)
    if compute_dtype == "float32" and config.dtype != "float32":
        report(0.9, f"{config.dtype} weights, float32 compute (faster on this CPU)")
        compute_in_float32_(model)
    notes = []
    if config.dtype == "int8" and not has_int8_dot_product():
        notes.append(INT8_WITHOUT_VNNI)
    if config.kernels == "packed":
        # The language model's Linears are packed by the decode backend, which may compile them instead.
        notes.extend(pack_remaining_linears(model.model.visual, compute_dtype, report))
    for note in notes:
        log.warning("%s", note)
    return compute_dtype, notes


