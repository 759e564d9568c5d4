"""Errors a caller can show to a user as they are: each message says what went wrong and what to do."""


class VlscopeError(Exception):
    """Base of every error the engine raises on purpose. `kind` is a short stable name for metrics and APIs."""

    kind = "error"
    about: str | None = None  # the part of the request at fault, as the API's `param` names it

    def __init__(self, message: str, about: str | None = None):
        super().__init__(message)
        self.message = message
        if about is not None:
            self.about = about
        self.metrics = None  # the request's RequestMetrics, when the error belongs to a request


class InvalidImage(VlscopeError):
    kind = "invalid_image"
    about = "messages"


class InvalidVideo(VlscopeError):
    """A clip that cannot be read, has no video stream or frames, or is beyond a limit: refused before decoding."""

    kind = "invalid_video"
    about = "messages"


class PromptTooLong(VlscopeError):
    kind = "prompt_too_long"
    about = "messages"


class InvalidPrompt(VlscopeError):
    """The text carries one of the chat template's control tokens, which would act as one, or a setting that cannot
    go with the rest of the request."""

    kind = "invalid_prompt"
    about = "messages"


class InvalidSchema(VlscopeError):
    """A response format or tool the engine cannot hold an answer to: not JSON Schema, a keyword it does not enforce,
    or over a limit. `kind` names which (invalid_schema, unsupported_schema, schema_too_large, schema_too_complex,
    too_many_tools)."""

    kind = "invalid_schema"
    about = "response_format"  # or tools

    def __init__(self, message: str, kind: str | None = None, about: str | None = None):
        super().__init__(message, about)
        if kind is not None:
            self.kind = kind


class InsufficientMemory(VlscopeError):
    kind = "insufficient_memory"


class Busy(VlscopeError):
    kind = "busy"


class ModelUnavailable(VlscopeError):
    kind = "model_unavailable"

    def __init__(self, message: str, cause: str | None = None):
        super().__init__(message)
        self.cause = cause or message  # what went wrong alone, without the command-line advice


class Cancelled(VlscopeError):
    """Its caller cancelled the request before it was queued (while a clip's frames were decoded, say)."""

    kind = "cancelled"


class GenerationFailed(VlscopeError):
    kind = "internal"
