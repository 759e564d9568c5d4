"""Connections that never become requests: a client that sends half a header and waits, or opens hundreds of
connections from one address, holds sockets that no ASGI middleware ever sees, since uvicorn's HTTP protocols have
no header timeout. So they are extended here, h11's and httptools' (which uvicorn picks where it is installed): a
connection whose request headers are not complete within `api_header_seconds` of opening (or of its last response)
is closed, and an address may hold at most `api_max_connections_per_address` HTTP connections at once (websockets,
once upgraded, are the app's sessions)."""
from __future__ import annotations

import logging
import threading
from collections import Counter
from typing import Callable

log = logging.getLogger(__name__)

_open: Counter[str] = Counter()  # client address -> HTTP connections open now
_lock = threading.Lock()
_installed = False


def guard_connections(settings: Callable) -> None:
    """Extend uvicorn's HTTP protocols, h11's and httptools' alike (once per process, whichever the server picked
    or picks), with the header deadline and the per-address cap, read from `settings()` (the ServerSettings in
    force) as each connection opens."""
    global _installed
    if _installed:
        return
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    # h11 has read a request's headers once its peer is no longer idle; httptools says so in a callback.
    _extend(H11Protocol, settings, after_data=lambda protocol: protocol.conn.their_state is not h11.IDLE)
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:  # httptools is not installed: uvicorn runs h11
        pass
    else:
        _extend(HttpToolsProtocol, settings, headers_complete="on_headers_complete")
    _installed = True


def _extend(protocol_class, settings: Callable, after_data: Callable | None = None,
            headers_complete: str | None = None) -> None:
    """The deadline and the cap on one protocol class. The headers are complete when `after_data(protocol)` says
    so after data arrives, or when the class's `headers_complete` method is called."""
    made, lost, received = (protocol_class.connection_made, protocol_class.connection_lost,
                            protocol_class.data_received)
    completed, upgrade = protocol_class.on_response_complete, protocol_class.handle_websocket_upgrade

    def arm(protocol) -> None:
        disarm(protocol)
        seconds = protocol._vlscope_header_seconds
        protocol._vlscope_header_timer = protocol.loop.call_later(seconds, _header_timeout, protocol)

    def disarm(protocol) -> None:
        timer = getattr(protocol, "_vlscope_header_timer", None)
        if timer is not None:
            timer.cancel()
            protocol._vlscope_header_timer = None

    def release(protocol) -> None:
        address = getattr(protocol, "_vlscope_address", None)
        if address is not None:
            with _lock:
                _open[address] -= 1
                if _open[address] <= 0:
                    del _open[address]
            protocol._vlscope_address = None

    def connection_made(self, transport) -> None:
        made(self, transport)
        current = settings()
        self._vlscope_header_seconds = current.api_header_seconds
        address = self.client[0] if self.client else None
        if address is not None:
            with _lock:
                _open[address] += 1
                count = _open[address]
            self._vlscope_address = address
            if count > current.api_max_connections_per_address:
                log.warning("closing a connection from %s: %d open, the limit per address is %d", address, count,
                            current.api_max_connections_per_address)
                transport.close()
                return
        arm(self)

    def data_received(self, data: bytes) -> None:
        received(self, data)
        if after_data is not None and after_data(self):
            disarm(self)

    def on_response_complete(self) -> None:
        completed(self)
        if not self.transport.is_closing():
            arm(self)  # the next request's headers get the same deadline

    def handle_websocket_upgrade(self, *event) -> None:
        disarm(self)
        release(self)  # a websocket is an app session from here on, not an HTTP connection
        upgrade(self, *event)

    def connection_lost(self, exc) -> None:
        disarm(self)
        release(self)
        lost(self, exc)

    protocol_class.connection_made = connection_made
    protocol_class.data_received = data_received
    protocol_class.on_response_complete = on_response_complete
    protocol_class.handle_websocket_upgrade = handle_websocket_upgrade
    protocol_class.connection_lost = connection_lost
    if headers_complete is not None:
        original = getattr(protocol_class, headers_complete)

        def on_headers(self) -> None:
            disarm(self)
            original(self)

        setattr(protocol_class, headers_complete, on_headers)


def _header_timeout(protocol) -> None:
    protocol._vlscope_header_timer = None
    if not protocol.transport.is_closing():
        log.info("closing a connection from %s: no complete request header within %g s",
                 protocol.client[0] if protocol.client else "?", protocol._vlscope_header_seconds)
        protocol.transport.close()

