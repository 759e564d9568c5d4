"""vlscope's engine: Qwen3-VL on the CPU, concurrent requests decoded together, every stage measured. No Streamlit in here."""
from .config import DEFAULT_MODEL, DTYPES, SKELETON_DIR, EngineConfig
from .engine import Answer, Engine, EngineInfo, RequestHandle
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
from .metrics import RequestMetrics
from .request import ChatRequest, Queued, StageStarted, TextChunk, Turn
from .serving import ServingEngine
from .store import MetricsStore, stage_percentiles, to_csv
from .trace import STAGES, STATUSES

__all__ = [
    "Answer", "Busy", "ChatRequest", "DEFAULT_MODEL", "DTYPES", "Engine", "EngineConfig", "EngineInfo",
    "GenerationFailed", "InsufficientMemory", "InvalidImage", "InvalidPrompt", "MetricsStore", "ModelUnavailable", "PromptTooLong", "Queued",
    "RequestHandle", "RequestMetrics", "SKELETON_DIR", "ServingEngine", "STAGES", "STATUSES", "StageStarted", "TextChunk", "Turn",
    "VlscopeError", "stage_percentiles", "to_csv",
]
