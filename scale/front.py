"""The cluster's front door: Ray's HTTP proxy hands it every request; it checks host and key, reads the body, names
the conversation and forwards the request to a replica (scale/router.py picks which), relaying the answer as it
streams. It also keeps what the replicas report, for one /health and one /metrics of them all."""
from __future__ import annotations

import asyncio
import json
import logging
import time
from urllib.parse import parse_qsl

import anyio
import ray
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.exceptions import BackPressureError
from starlette.datastructures import Headers
from starlette.responses import JSONResponse, PlainTextResponse

from api.body import read_body
from api.errors import ApiError, error_response
from api.guard import ServerGuard, authorized
from server.settings import load_settings

from .conversation import conversation_key
from .metrics import cluster_metrics
from .ports import serve_grpc_on_node_address
from .records import cluster_records
from .replica import REPLICA_HEADER, REPORT_S

log = logging.getLogger("vlscope.scale")
STALE_S = 3 * REPORT_S + 2  # a replica silent this long is gone (its process died or is being replaced)
SCOPE_KEYS = ("type", "asgi", "http_version", "method", "scheme", "path", "raw_path", "query_string", "headers",
              "client", "server")
TRIES = 2  # a replica lost before it answered: the request goes once more to another
RECORDS_LIMIT = 2_000  # records one /metrics/records answer holds


class ReplicaSilent(Exception):
    """The replica answering a request is gone without Ray saying so: its stream ended before its last message, or
    it stopped reporting (its node died or vanished)."""


def _lost(error: Exception) -> ApiError:
    return ApiError(503, f"the replica answering this request stopped ({type(error).__name__}); ask again",
                    "server_error", "replica_lost", retry_after=1)


class Front:
    """A Ray Serve ingress deployment (made one in scale/app.py). `replicas` is the handle of the replicas'
    deployment; `settings` the VLSCOPE_* variables every replica also gets."""

    def __init__(self, replicas, settings: dict[str, str]):
        serve_grpc_on_node_address()
        loaded = load_settings(settings)
        self.server, self.engine = loaded.server, loaded.engine
        self.replicas = replicas
        self.board: dict[str, dict] = {}
        self.records = cluster_records()
        self.node_id = ray.get_runtime_context().get_node_id()

    def __serve_build_asgi_app__(self):
        async def refuse(error: ApiError, path: str = ""):
            return error_response(error)  # the replicas record what they refuse; the front only turns away
        return ServerGuard(self._asgi, settings=lambda: self.server, signed_in=lambda session_id: None, refuse=refuse)

    async def report(self, snapshot: dict) -> None:
        """A replica's health and metrics, sent every REPORT_S seconds."""
        self.board[snapshot["replica"]] = snapshot

    def live(self) -> list[dict]:
        now = time.time()
        for replica in [r for r, snap in self.board.items() if now - snap["at"] > STALE_S]:
            del self.board[replica]
            self.records.lost.remote(replica)  # whatever it was answering will not finish
        return sorted(self.board.values(), key=lambda snap: snap["started"])

    async def _records(self, scope) -> JSONResponse:
        """The cluster's records, newest first: `since` (unix seconds, default the last hour) and `limit` (at most
        RECORDS_LIMIT)."""
        query = dict(parse_qsl(scope.get("query_string", b"").decode("latin-1")))
        try:
            since = float(query.get("since", time.time() - 3600))
            limit = min(int(query.get("limit", RECORDS_LIMIT)), RECORDS_LIMIT)
        except ValueError:
            return error_response(ApiError(400, "since is unix seconds and limit a whole number", param="query"))
        records, total = await asyncio.gather(self.records.between.remote(since, None, limit),
                                              self.records.count_since.remote(since))
        return JSONResponse({"records": records, "total": total})

    async def _asgi(self, scope, receive, send):
        if scope["type"] == "lifespan":  # nothing to start or stop: the replicas hold the engines
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            return await send({"type": "lifespan.shutdown.complete"})
        if scope["type"] != "http":
            return await send({"type": "websocket.close", "code": 1008})
        if scope["path"] == "/health":
            return await self._health(scope)(scope, receive, send)
        if scope["path"] == "/metrics/records":  # the guard has checked the key
            return await (await self._records(scope))(scope, receive, send)
        if scope["path"] == "/metrics":  # the guard has checked the key
            return await PlainTextResponse(cluster_metrics(self.live()),
                                           media_type="text/plain; version=0.0.4")(scope, receive, send)
        try:
            body = await self._body(scope, receive)
            await self._forward(scope, body, send)
        except ApiError as error:
            await error_response(error)(scope, receive, send)

    def _health(self, scope) -> JSONResponse:
        replicas = self.live()
        ready = [snap for snap in replicas if snap["status"] == 200]
        status = "ready" if ready else "loading"
        if not authorized(Headers(scope=scope), self.server.api_keys):
            return JSONResponse({"status": status}, status_code=200 if ready else 503)
        body = {"status": status, "front_node_id": self.node_id,
                "queue_depth": sum(snap["health"].get("queue_depth", 0) for snap in replicas),
                "replicas": [{"replica": snap["replica"], "pid": snap["pid"], "node": snap["node"],
                              "node_id": snap["node_id"],
                              "status": snap["health"]["status"], "queue_depth": snap["health"].get("queue_depth", 0),
                              "rss_bytes": snap["rss_bytes"]} for snap in replicas]}
        if ready:
            body |= {key: ready[0]["health"][key] for key in ("model", "synthetic", "dtype")}
        return JSONResponse(body, status_code=200 if ready else 503)

    async def _body(self, scope, receive) -> bytes:
        """The whole body, read and checked as a replica reads it (which checks it again)."""
        async def parts():
            more = True
            while more:
                message = await receive()
                if message["type"] == "http.disconnect":
                    raise ApiError(499, "the client went away", code="client_closed")
                yield message.get("body", b"")
                more = message.get("more_body", False)
        return await read_body(Headers(scope=scope), parts(), self.server, self.engine)

    async def _watched(self, answer, replica):
        """The answer's messages; ReplicaSilent when they end before the last one (Ray ends the stream of a replica
        whose node died as if it were complete), or when `replica()` (its id, once the answer began) stops reporting
        (a node gone without a word)."""
        messages = answer.__aiter__()
        following = None
        try:
            while True:
                following = following or asyncio.ensure_future(messages.__anext__())
                done, _ = await asyncio.wait({following}, timeout=REPORT_S)
                if not done:
                    answering = replica()
                    if isinstance(answering, str) and answering not in {snap["replica"] for snap in self.live()}:
                        raise ReplicaSilent(f"replica {answering} has not reported for {STALE_S:g} s")
                    continue
                try:
                    message = following.result()
                except StopAsyncIteration:
                    raise ReplicaSilent("the answer ended before its last message") from None
                following = None
                yield message
                if message["type"] == "http.response.body" and not message.get("more_body", False):
                    return
        finally:
            if following is not None:
                following.cancel()

    async def _forward(self, scope, body: bytes, send) -> None:
        headers = {name.decode("latin-1").lower(): value.decode("latin-1") for name, value in scope["headers"]}
        # Parsing a large body holds the event loop, and every stream through it: a thread parses it.
        key = await anyio.to_thread.run_sync(conversation_key, headers, body) if scope["method"] == "POST" else None
        sent = {name: scope[name] for name in SCOPE_KEYS if name in scope} | {"root_path": ""}
        for attempt in range(TRIES):
            started, streaming = False, False
            answer = self.replicas.options(stream=True).forward.remote(sent, body, conversation=key)
            try:
                async for message in self._watched(answer, lambda: started):
                    if message["type"] == "http.response.start":
                        started = dict(message.get("headers", [])).get(REPLICA_HEADER, b"").decode() or True
                        streaming = any(name == b"content-type" and value.startswith(b"text/event-stream")
                                        for name, value in message.get("headers", []))
                    await send(message)
                return
            except BackPressureError:
                raise ApiError(429, "every replica is full; try again shortly", "rate_limit_error", "busy",
                               retry_after=5) from None
            except (RayActorError, ActorUnavailableError, ReplicaSilent) as error:
                log.warning("a replica was lost %s its answer: %s", "during" if started else "before", error)
                if isinstance(started, str):
                    await self.records.lost.remote(started)
                if not started and attempt + 1 < TRIES:
                    continue
                if not started:
                    raise _lost(error) from None
                if streaming:  # the client has its 200: the stream ends with an error event, as a replica's own do
                    await send({"type": "http.response.body", "more_body": True,
                                "body": f"data: {json.dumps(_lost(error).body())}\n\ndata: [DONE]\n\n".encode()})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                return
            finally:
                answer.cancel()
