"""How large a request body a server takes: one number for the single server and for a cluster's front."""
from __future__ import annotations

from engine.config import EngineConfig
from server.settings import ServerSettings


def body_limit(server: ServerSettings, config: EngineConfig) -> int:
    """VLSCOPE_API_MAX_BODY_BYTES, else the body an allowed request can need: one image at the byte limit,
    base64-encoded, and 1 MiB for the rest (no text over the prompt limit's characters gets that far)."""
    return server.api_max_body_bytes or config.max_image_bytes * 4 // 3 + 4 + (1 << 20)
