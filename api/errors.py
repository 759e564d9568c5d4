"""The API's error: an HTTP status, OpenAI's error type and code, and a message shown to the client as it is."""
from __future__ import annotations


class ApiError(Exception):
    """An error with its HTTP status and OpenAI error type; the message is shown to the client as it is."""

    def __init__(self, status: int, message: str, error_type: str = "invalid_request_error", code: str | None = None,
                 retry_after: int | None = None, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.error_type, self.code, self.retry_after, self.param = (
            status, message, error_type, code, retry_after, param)
        self.recorded = False  # True when an engine already stored the request's record

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param, "code": self.code}}


def error_response(error: ApiError):
    """The error as the JSON response a client gets, with Retry-After when there is one."""
    from starlette.responses import JSONResponse
    headers = {"Retry-After": str(error.retry_after)} if error.retry_after else None
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


def unsupported(param: str, message: str) -> ApiError:
    return ApiError(400, message, code="unsupported_parameter", param=param)
