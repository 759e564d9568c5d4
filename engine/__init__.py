"""vlscope's engine: Qwen3-VL on the CPU, concurrent requests decoded together, every stage measured. No Streamlit in here."""
from .config import DEFAULT_MODEL, DTYPES, SKELETON_DIR, EngineConfig
from .errors import (
                     Busy,
                     GenerationFailed,
                     InsufficientMemory,
                     InvalidImage,
                     InvalidPrompt,
                     ModelUnavailable,
                     PromptTooLong,
                     VlscopeError,
)
from .records.metrics import RequestMetrics
from .request import ChatRequest, Queued, StageStarted, TextChunk, Turn
from .records.store import MetricsStore, stage_percentiles, to_csv
from .records.stages import STAGES, STATUSES

# The engine itself imports torch and transformers (seconds): loaded on first use, so that the command line's help,
# its input errors and the measuring tools' light paths start at once.
_LAZY = {"Answer": "client", "Engine": "client", "EngineInfo": "client", "RequestHandle": "client",
         "ServingEngine": "serving"}


def __getattr__(name: str):
    if name in _LAZY:
        from importlib import import_module

        return getattr(import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    "Answer", "Busy", "ChatRequest", "DEFAULT_MODEL", "DTYPES", "Engine", "EngineConfig", "EngineInfo",
    "GenerationFailed", "InsufficientMemory", "InvalidImage", "InvalidPrompt", "MetricsStore", "ModelUnavailable", "PromptTooLong", "Queued",
    "RequestHandle", "RequestMetrics", "SKELETON_DIR", "ServingEngine", "STAGES", "STATUSES", "StageStarted", "TextChunk", "Turn",
    "VlscopeError", "stage_percentiles", "to_csv",
]
