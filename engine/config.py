"""The engine's settings (`EngineConfig`), and the one reader of every `VLSCOPE_*` setting, the server's too
(server/settings.py declares those: who may call the API and the app, what the API accepts).

Each comes from, in rising order of precedence: its default, the `[vlscope]` table of Streamlit's `secrets.toml`
(`~/.streamlit/` then `./.streamlit/`, or the table the app passes from `st.secrets`), and a `VLSCOPE_<NAME>`
environment variable. No other module reads `VLSCOPE_*` variables."""
from __future__ import annotations

import dataclasses
import os
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

PROJECT_DIR = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = "Qwen/Qwen3-VL-2B-Instruct"
# The bundled copy of the model's config and tokenizer, without weights: the app falls back to it offline.
SKELETON_DIR = PROJECT_DIR / "models" / "qwen3-vl-2b-skeleton"

DTYPES = ("float32", "bfloat16", "int8", "int4")
# The precisions whose language model multiplies int8 activations (one scale per row) by integer weights.
INTEGER_DTYPES = ("int8", "int4")
# What bfloat16, int8 and int4 weights compute in. auto: bfloat16 where this CPU's bfloat16 matmul measures faster
# than float32, else float32 with the weights kept compact (engine/kernels/quantize.py).
COMPUTE_DTYPES = ("auto", "float32", "bfloat16")
# How Linear layers run. packed: weights reordered once at load for oneDNN (float32, bfloat16) or fbgemm (int8,
# int8 activations), the fastest measured here; plain: PyTorch's stock kernels (parity tests, the bench's baseline).
KERNELS = ("packed", "plain")
COMPILE_MODES = ("auto", "on", "off")
DRAFTS = ("int8", "off")
# Shorter names people type, beside the VLSCOPE_<FIELD> ones.
ENV_ALIASES = {"db_path": "VLSCOPE_DB"}
# One vision token covers a 32x32 pixel block (16-pixel patches merged 2x2).
PIXELS_PER_VISION_TOKEN = 32 * 32


def looks_like_hub_id(source: str) -> bool:
    """'org/name' or 'name', as the hub spells ids; anything else with a slash is a filesystem path."""
    return re.fullmatch(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?", source) is not None


def default_threads() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


@dataclass(frozen=True)
class EngineConfig:
    model: str = DEFAULT_MODEL
    dtype: str = "float32"
    compute_dtype: str = "auto"
    kernels: str = "packed"
    # The direct decode step compiled with inductor, segment by segment (engine/model/decode_backend.py): auto compiles where it
    # is measured faster at load (bfloat16 on CPUs that compute in it, where fbgemm's float16 products are missing),
    # on always tries, off never does.
    compile: str = "auto"
    # float32 decode drafts tokens with an int8 copy of the language model and checks them four at a time
    # (engine/model/draft.py): float32's own tokens, faster, for the copy's memory; off decodes a token a step.
    draft: str = "int8"
    # A structured answer's tokens that its grammar allows alone go into the model with the next step's token, as
    # rows beside it (engine_core.jump_forward): the same answer in fewer steps; off feeds them a step each.
    jump_forward: bool = True
    threads: int = dataclasses.field(default_factory=default_threads)
    kv_cache: bool = True
    # Recent conversations whose KV cache is kept, so a follow-up skips re-encoding and re-prefilling them.
    prefix_cache_entries: int = 2
    # Image token budget. The upper bound keeps any single image at or under 1,024 vision tokens.
    min_pixels: int = 64 * PIXELS_PER_VISION_TOKEN
    max_pixels: int = 1024 * PIXELS_PER_VISION_TOKEN
    max_new_tokens: int = 512
    # The default answer length where the weights are synthetic (their answers are noise that runs to the cap); a
    # request's own max_tokens still reaches max_new_tokens. 0: no lower default.
    synthetic_max_new_tokens: int = 128
    max_input_tokens: int = 8192
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    seed: int = 0
    warmup: bool = True
    max_queue: int = 8
    # Sequences decoded together, one token each per step (engine/core/scheduler.py): a step for four costs little more
    # than a step for one, since both read every weight once (docs/decisions.md, "Batched decode").
    max_batch: int = 4
    db_path: str = "data/vlscope.db"
    # Retention of the metrics database, pruned in the background as records are added (0: keep all).
    records_keep_days: int = 30
    records_max_rows: int = 100_000
    store_content: bool = False
    # Refuse images larger than this before decoding them (decompression bombs).
    max_image_pixels: int = 64_000_000
    max_image_bytes: int = 50 * 1024 * 1024
    # All images of one request together, read from their headers before any is decoded.
    max_request_pixels: int = 128_000_000
    # Pages of PDFs (and multi-page TIFFs) one request may carry; each page is one image to the model.
    max_pdf_pages: int = 8
    # Images (a document counting as one) in one request, its history included: counted before any is decoded.
    max_images: int = 16
    # Video clips: read from the container's header before any frame is decoded, refused beyond these limits, then
    # sampled at video_fps (Qwen3-VL's 2 by default) within video_max_tokens vision tokens a clip.
    max_video_bytes: int = 200 * 1024 * 1024
    max_video_seconds: float = 3600.0
    max_video_pixels: int = 3840 * 2160 * 2  # a frame's stored size: 4K with room for taller formats
    max_videos: int = 2  # clips in one request, its history included
    # The decoding one clip may cost, in megapixels decoded and in seconds (a clip whose keyframes are too sparse,
    # or whose frames are too slow to decode, is refused when it passes either).
    max_video_decode_megapixels: float = 12_000.0
    max_video_decode_seconds: float = 10.0
    video_fps: float = 2.0
    video_max_tokens: int = 2048
    # Structured answers (response_format, tools): checked and compiled at submit, refused with a 400 over these.
    max_schema_bytes: int = 256 * 1024  # a response format's schema, or all tools' definitions together
    max_schema_depth: int = 32  # objects and arrays nested in a schema
    max_tools: int = 128
    grammar_compile_seconds: float = 2.0  # a schema whose grammar takes longer to build is refused as too complex
    grammar_cache_entries: int = 64  # compiled grammars kept, by schema
    grammar_cache_bytes: int = 256 * 1024 * 1024  # and the memory they may hold together, as built
    # Memory a request may use beyond the weights; 0: whatever the machine has available when it starts.
    memory_limit_bytes: int = 0
    # A remote OpenAI-compatible server instead of a local model (e.g. http://host:8000/v1): vLLM, llama.cpp,
    # Ollama or another vlscope. Empty: the local model.
    remote_url: str = ""
    remote_api_key: str = ""
    remote_model: str = ""
    # The model id the API shows and accepts: empty means the hub id, or the model folder's name (never a path).
    served_model_name: str = ""
    # Accept any `model` in API requests (served by this one model) instead of answering 404 model_not_found.
    api_any_model: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, not {self.dtype!r}")
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"compute_dtype must be one of {', '.join(COMPUTE_DTYPES)}, not {self.compute_dtype!r}")
        if self.compile not in COMPILE_MODES:
            raise ValueError(f"compile must be one of {', '.join(COMPILE_MODES)}, not {self.compile!r}")
        if self.draft not in DRAFTS:
            raise ValueError(f"draft must be one of {', '.join(DRAFTS)}, not {self.draft!r}")
        if self.kernels not in KERNELS:
            raise ValueError(f"kernels must be one of {', '.join(KERNELS)}, not {self.kernels!r}")
        if self.threads < 1:
            raise ValueError("threads must be at least 1")
        if not 0 < self.min_pixels <= self.max_pixels:
            raise ValueError("need 0 < min_pixels <= max_pixels")
        if self.synthetic_max_new_tokens < 0:
            raise ValueError("synthetic_max_new_tokens must be 0 (no lower default) or more")
        if self.max_new_tokens < 1 or self.max_input_tokens < 1:
            raise ValueError("max_new_tokens and max_input_tokens must be at least 1")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ValueError("need temperature >= 0 and 0 < top_p <= 1")
        if self.max_queue < 0:
            raise ValueError("max_queue must be >= 0")
        if self.max_batch < 1:
            raise ValueError("max_batch must be at least 1")
        if min(self.max_schema_bytes, self.max_schema_depth, self.max_tools) < 1 or self.grammar_compile_seconds <= 0:
            raise ValueError("max_schema_bytes, max_schema_depth, max_tools and grammar_compile_seconds must be > 0")
        if self.max_pdf_pages < 1 or self.max_images < 1:
            raise ValueError("max_pdf_pages and max_images must be at least 1")
        if not 0 < self.video_fps <= 30 or self.video_max_tokens < 256 or self.max_videos < 0:
            raise ValueError("need 0 < video_fps <= 30, video_max_tokens >= 256 (two patches of 128 tokens) and "
                             "max_videos >= 0")
        if self.records_keep_days < 0 or self.records_max_rows < 0:
            raise ValueError("records_keep_days and records_max_rows must be >= 0 (0 keeps all)")

    @property
    def max_vision_tokens(self) -> int:
        return self.max_pixels // PIXELS_PER_VISION_TOKEN

    def replace(self, **changes) -> "EngineConfig":
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides) -> "EngineConfig":
        """The configured settings (see the module's docstring); explicit overrides win."""
        return read_settings(cls, env).replace(**{k: v for k, v in overrides.items() if v is not None})


def secrets_table(paths: tuple[Path, ...] | None = None) -> dict:
    """The `[vlscope]` table of the secrets files Streamlit reads, the project's over the user's. Unreadable or
    missing files count as empty: defaults and the environment still apply."""
    paths = paths or (Path.home() / ".streamlit" / "secrets.toml", Path.cwd() / ".streamlit" / "secrets.toml")
    table: dict = {}
    for path in paths:
        try:
            with open(path, "rb") as file:
                table.update(tomllib.load(file).get("vlscope", {}))
        except (OSError, tomllib.TOMLDecodeError, AttributeError):
            continue
    return table


def read_settings(cls, env: Mapping[str, str] | None = None, secrets: Mapping | None = None):
    """A settings class (`EngineConfig`, or the server's ServerSettings) filled from `VLSCOPE_<NAME>` in `env`
    (default os.environ) over `secrets` (default: the secrets files' `[vlscope]` table) over its defaults. Raises
    ValueError naming the setting when a value does not parse."""
    env = os.environ if env is None else env
    secrets = secrets_table() if secrets is None else secrets
    found: dict = {}
    for field in dataclasses.fields(cls):
        raw = env.get(variable(field.name))
        if raw is None and field.name in ENV_ALIASES:
            raw = env.get(ENV_ALIASES[field.name])
        if raw is None and field.name in secrets:
            raw = _as_text(secrets[field.name])
        if raw is None or raw == "":
            continue
        found[field.name] = _parse(field.name, raw, field.type)
    return cls(**found)


def setting_names(*classes) -> list[str]:
    """Every setting's environment variable name, in the order the classes (default EngineConfig) declare them."""
    return [variable(field.name) for cls in classes or (EngineConfig,) for field in dataclasses.fields(cls)]


def variable(name: str) -> str:
    """The environment variable of the setting `name` (a field of EngineConfig or the server's ServerSettings)."""
    return f"VLSCOPE_{name.upper()}"


def settings_in_environment(*classes, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables of the settings `classes` (default EngineConfig) set in `env` (default os.environ), aliases
    included: what another process of the same server (a cluster's replica) must be given to serve alike."""
    env = os.environ if env is None else env
    names = set(setting_names(*classes)) | set(ENV_ALIASES.values())
    return {name: value for name, value in env.items() if name in names}



def _as_text(value) -> str:
    """A secrets value (TOML gives bools, numbers, lists) as the text an environment variable would hold."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, (list, tuple)):
        return ",".join(str(item) for item in value)
    return str(value)


def _parse(name: str, raw: str, type_name: str):
    try:
        if type_name == "bool":
            if raw.strip().lower() in ("1", "true", "yes", "on"):
                return True
            if raw.strip().lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        if type_name == "int":
            return int(raw)
        if type_name == "float":
            return float(raw)
        if type_name.startswith("tuple"):
            return tuple(item.strip() for item in raw.split(",") if item.strip())
        return raw
    except ValueError:
        raise ValueError(f"VLSCOPE_{name.upper()}={raw!r} is not a valid {type_name}") from None
