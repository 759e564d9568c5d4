"""The API alone as an ASGI app, its routes behind the same guard as in the Streamlit server: what a replica of a
cluster serves (scale/), where no page is drawn."""
from __future__ import annotations

from starlette.routing import Router

from server.slot import server_settings

from .guard import ServerGuard
from .routes import refuse, routes


def api_app():
    """Routes and guard; the caller loads the engine (server.slot.ensure_loaded). No app sign-in: no pages."""
    return ServerGuard(Router(routes=routes), settings=server_settings, signed_in=lambda session_id: None,
                       refuse=refuse)
