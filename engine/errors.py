"""Errors a caller can show to a user as they are: each message says what went wrong and what to do."""


class VlscopeError(Exception):
    """Base of every error the engine raises on purpose. `kind` is a short stable name for metrics and APIs."""

    kind = "error"

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message
        self.metrics = None  # the request's RequestMetrics, when the error belongs to a request


class InvalidImage(VlscopeError):
    kind = "invalid_image"


class PromptTooLong(VlscopeError):
    kind = "prompt_too_long"


class InvalidPrompt(VlscopeError):
    """The text carries one of the chat template's control tokens, which would act as one."""

    kind = "invalid_prompt"


class InsufficientMemory(VlscopeError):
    kind = "insufficient_memory"


class Busy(VlscopeError):
    kind = "busy"


class ModelUnavailable(VlscopeError):
    kind = "model_unavailable"


class GenerationFailed(VlscopeError):
    kind = "internal"
