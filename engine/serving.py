"""What a server needs of an engine: the local one and a remote backend both are one, so the API and the UI never
ask which they hold."""
from __future__ import annotations

import threading
from typing import Iterator, Protocol

from .config import EngineConfig
from .client import Answer, Event, RequestHandle
from .records.info import EngineInfo
from .request import ChatRequest


class ServingEngine(Protocol):
    config: EngineConfig
    info: EngineInfo
    model_name: str  # the model as this engine names it to its clients
    serves_logprobs: bool  # whether token_text can read its tokens: a remote backend's are out of reach

    @property
    def queue_depth(self) -> int: ...

    @property
    def active_sequences(self) -> int: ...

    def batch_limit(self) -> int: ...

    def submit(self, request: ChatRequest, cancelled: threading.Event | None = None) -> RequestHandle: ...

    def stream(self, request: ChatRequest) -> Iterator[Event]: ...

    def ask(self, request: ChatRequest) -> Answer: ...

    def token_text(self, token: int) -> str: ...

    def close(self) -> None: ...
