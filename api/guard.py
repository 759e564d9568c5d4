"""What the server checks before any route runs: that every request, the app's page, websocket, uploads and media
as well as the API, names one of this server's hosts (a DNS rebinding guard) and comes from an allowed origin when
a browser sends one; that API calls carry one of the API keys when keys are set; and that uploads to the app wait
for sign-in.

An ASGI middleware around the whole st.App, so it sees Streamlit's routes (the upload endpoint) as well as ours."""
from __future__ import annotations

import hmac
import ipaddress
import socket
from urllib.parse import urlparse

from starlette.datastructures import Headers

from .errors import ApiError

API_PREFIXES = ("/v1/", "/metrics")
UPLOAD_PREFIX = "/_stcore/upload_file/"
LOCAL_NAMES = {"localhost", "localhost.localdomain"}


def _host_name(host_header: str) -> str:
    """The name in a Host header, without its port; IPv6 literals keep no brackets."""
    host = host_header.strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return False


def machine_names() -> set[str]:
    names = set(LOCAL_NAMES)
    for name in (socket.gethostname(), socket.getfqdn()):
        if name:
            names.add(name.lower())
    return names


def host_allowed(host_header: str, allowed: tuple[str, ...], names: set[str]) -> bool:
    """IP literals, localhost and this machine's own names always; other names only when listed."""
    name = _host_name(host_header)
    return bool(name) and (_is_ip(name) or name in names or name in {h.lower() for h in allowed})


def origin_allowed(origin: str, host_header: str, allowed: tuple[str, ...]) -> bool:
    """No Origin (not a browser, or a same-origin GET), the page's own origin, or one the operator listed."""
    if not origin:
        return True
    return urlparse(origin).netloc.lower() == host_header.strip().lower() or origin.rstrip("/") in {
        o.rstrip("/") for o in allowed}


def authorized(headers: Headers, keys: tuple[str, ...]) -> bool:
    """No keys set, or `Authorization: Bearer <one of them>`."""
    if not keys:
        return True
    header = headers.get("authorization", "")
    token = header[7:] if header.lower().startswith("bearer ") else ""
    # Compared as bytes: compare_digest refuses non-ASCII str, and a key is never a reason for a 500.
    return any(hmac.compare_digest(token.encode("utf-8", "surrogateescape"), key.encode()) for key in keys)


class ServerGuard:
    """ASGI middleware. `settings()` gives the ServerSettings in force; `signed_in(session_id)` whether an app
    session has signed in (None when the app has no sign-in); `refuse(error, path)` records a refusal."""

    def __init__(self, app, settings, signed_in, refuse):
        self.app, self.settings, self.signed_in, self.refuse = app, settings, signed_in, refuse
        self.names = machine_names()

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        path: str = scope["path"]
        headers = Headers(scope=scope)
        settings = self.settings()
        host = headers.get("host", "")
        error = None
        if not host_allowed(host, settings.allowed_hosts, self.names):
            error = ApiError(403, f"this server does not answer to the host {_host_name(host)!r}; add it to "
                                  "VLSCOPE_ALLOWED_HOSTS", "permission_error", "host_not_allowed")
        elif not origin_allowed(headers.get("origin", ""), host, settings.allowed_origins):
            error = ApiError(403, "cross-origin requests from this web page are refused; allow its origin in "
                                  "VLSCOPE_ALLOWED_ORIGINS", "permission_error", "origin_not_allowed")
        elif scope["type"] == "websocket":
            return await self.app(scope, receive, send)
        elif path.startswith(API_PREFIXES):
            if headers.get("origin") and scope["method"] == "OPTIONS":
                return await _preflight(headers.get("origin"), send)
            else:
                if headers.get("origin"):  # a browser may read the answer, a 401 included
                    send = _with_cors(send, headers.get("origin"))
                if not authorized(headers, settings.api_keys):
                    error = ApiError(401, "a valid API key is required (Authorization: Bearer <key>)",
                                     "authentication_error", "invalid_api_key")
        elif path.startswith(UPLOAD_PREFIX) and scope["method"] in ("PUT", "POST"):
            session_id = path[len(UPLOAD_PREFIX):].split("/", 1)[0]
            if self.signed_in(session_id) is False:
                error = ApiError(401, "sign in before uploading", "authentication_error", "sign_in_required")
        if error is None:
            return await self.app(scope, receive, send)
        response = await self.refuse(error, path)
        if scope["type"] == "websocket":  # closed before it is accepted: the server answers the handshake 403
            await send({"type": "websocket.close", "code": 1008})
            return
        await response(scope, receive, send)


async def _preflight(origin: str, send) -> None:
    await send({"type": "http.response.start", "status": 204, "headers": [
        (b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"Origin"),
        (b"access-control-allow-methods", b"GET, POST, OPTIONS"),
        (b"access-control-allow-headers", b"Authorization, Content-Type"),
        (b"access-control-max-age", b"600")]})
    await send({"type": "http.response.body", "body": b""})


def _with_cors(send, origin: str):
    async def wrapped(message):
        if message["type"] == "http.response.start":
            message = dict(message, headers=list(message.get("headers", [])) + [
                (b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"Origin")])
        await send(message)
    return wrapped
