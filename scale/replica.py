"""One replica: the API (api/app.py) over its own engine, called by the front through a Ray handle with the HTTP
request's scope and body, answering with the ASGI messages the API sends."""
from __future__ import annotations

import asyncio
import logging
import os
import socket
import time

import ray
from ray import serve

log = logging.getLogger("vlscope.scale")
REPORT_S = 1.0  # how often a replica tells the front its health and metrics
REPLICA_HEADER = b"x-vlscope-replica"


async def asgi_messages(app, scope: dict, body: bytes):
    """Run an ASGI app on one request whose body has arrived; yield what it sends. Closing this generator (the
    client went away, so Ray cancelled the call) tells the app the client disconnected, which cancels the answer."""
    sent = asyncio.Queue()
    disconnected = asyncio.Event()
    delivered = False

    async def receive():
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        await sent.put(message)

    done = object()
    task = asyncio.ensure_future(app(scope, receive, send))
    task.add_done_callback(lambda _: sent.put_nowait(done))
    try:
        while (message := await sent.get()) is not done:
            yield message
        task.result()
    finally:
        disconnected.set()
        if not task.done():
            try:  # the app's own clean-up (the engine request cancelled) gets a moment before it is cut short
                await asyncio.wait_for(asyncio.shield(task), 2.0)
            except (asyncio.TimeoutError, asyncio.CancelledError, Exception):
                task.cancel()


class Replica:
    """A Ray Serve deployment class (made one in scale/app.py). `settings` are VLSCOPE_* variables for this
    replica's engine and server; the model loads in the constructor, so Ray routes to a replica only once it is
    loaded, and its health check fails whenever the engine is not ready."""

    async def __init__(self, settings: dict[str, str], front_name: str):
        from .ports import serve_grpc_on_node_address
        from .records import ReplicaRecords, cluster_records
        serve_grpc_on_node_address()
        context = serve.get_replica_context()
        self.id = context.replica_id.unique_id
        os.environ.update(settings)
        from server.slot import use_store
        use_store(ReplicaRecords(self.id, cluster_records()))
        from api.app import api_app
        from server.slot import engine_slot, ensure_loaded

        self.app_name = context.app_name
        self.front_name = front_name
        self.started = time.time()
        if await asyncio.to_thread(ensure_loaded) is None:
            raise RuntimeError(f"the model did not load: {engine_slot().error}")
        self.app = api_app()
        self.reporter = asyncio.create_task(self._report_forever())
        log.info("replica %s ready (pid %d)", self.id, os.getpid())

    def __del__(self) -> None:
        from .records import remove_scratch
        remove_scratch(self.id)

    async def check_health(self) -> None:
        from server.slot import engine_slot
        slot = engine_slot()
        if not slot.ready or not getattr(slot.loaded.engine, "alive", True):
            raise RuntimeError(f"the engine is not ready: {slot.error or 'stopped'}")

    async def forward(self, scope: dict, body: bytes, conversation: str | None = None):
        """One HTTP request, answered as ASGI messages; `conversation` is read by the router only."""
        async for message in asgi_messages(self.app, scope, body):
            if message["type"] == "http.response.start":
                message = dict(message, headers=[*message.get("headers", []), (REPLICA_HEADER, self.id.encode())])
            yield message

    def snapshot(self) -> dict:
        """What the front shows of this replica: its health, its metrics (the same text its /metrics gives) and
        where it runs."""
        import psutil

        from api.routes import health_state, metrics_text
        status, health = health_state()
        return {"replica": self.id, "pid": os.getpid(), "node": socket.gethostname(),
                "node_id": ray.get_runtime_context().get_node_id(), "status": status,
                "health": health, "metrics": metrics_text(), "rss_bytes": psutil.Process().memory_info().rss,
                "started": self.started, "at": time.time()}

    async def _report_forever(self) -> None:
        front = None
        while True:
            try:
                front = front or serve.get_deployment_handle(self.front_name, app_name=self.app_name)
                snapshot = await asyncio.to_thread(self.snapshot)
                await front.report.remote(snapshot)
            except Exception as exc:  # the front restarting, or not deployed yet: try again next time
                log.debug("report to the front failed: %s", exc)
            await asyncio.sleep(REPORT_S)
