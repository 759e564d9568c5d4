"""vlscope's engine: Qwen3-VL on the CPU, concurrent requests decoded together, every stage measured. No Streamlit in here."""
from .client import Answer, Engine, RequestHandle
from .config import DEFAULT_MODEL, DTYPES, SKELETON_DIR, EngineConfig
from .errors import (
                     Busy,
                     Cancelled,
                     GenerationFailed,
                     InsufficientMemory,
                     InvalidImage,
                     InvalidPrompt,
                     InvalidSchema,
                     InvalidVideo,
                     ModelUnavailable,
                     PromptTooLong,
                     VlscopeError,
)
from .records.info import EngineInfo
from .records.metrics import RequestMetrics
from .records.stages import STAGES, STATUSES
from .records.store import MetricsStore, open_store, stage_percentiles, to_csv
from .request import ChatRequest, Queued, StageProgress, StageStarted, TextChunk, Tool, ToolCall, Turn
from .serving import ServingEngine

__all__ = [
    "Answer", "Busy", "Cancelled", "ChatRequest", "DEFAULT_MODEL", "DTYPES", "Engine", "EngineConfig", "EngineInfo",
    "GenerationFailed", "InsufficientMemory", "InvalidImage", "InvalidPrompt", "InvalidSchema", "InvalidVideo", "MetricsStore", "ModelUnavailable",
    "PromptTooLong", "Queued", "RequestHandle", "RequestMetrics", "SKELETON_DIR", "ServingEngine", "STAGES", "STATUSES",
    "StageProgress", "StageStarted", "TextChunk", "Tool", "ToolCall", "Turn", "VlscopeError", "open_store",
    "stage_percentiles", "to_csv",
]
