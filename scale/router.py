"""Ray Serve's request router for the replicas: a conversation goes to the replica that answered its first turn,
while that one is alive and has room; requests of no conversation go to the less loaded of two."""
from __future__ import annotations

import hashlib
import random
from collections import OrderedDict

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

REMEMBERED = 100_000  # conversations whose replica is remembered; the oldest are forgotten first


def _weight(key: str, replica: RunningReplica) -> bytes:
    return hashlib.blake2b(f"{key}|{replica.replica_id.unique_id}".encode(), digest_size=8).digest()


class ConversationRouter(RequestRouter):
    """Reads the `conversation` keyword of a replica call (scale/front.py). A new conversation's replica is the one
    its key ranks highest (rendezvous hashing), so a restarted front still finds it; a replica whose engine is full
    (`capacity`: its batch plus queue) ranks last, and the others are tried least loaded first."""

    def initialize_state(self, capacity: int = 0, **kwargs) -> None:
        self.capacity = capacity
        self.homes: OrderedDict[str, ReplicaID] = OrderedDict()

    def _full(self, replica: RunningReplica) -> bool:
        queued = self._replica_queue_len_cache.get(replica.replica_id)
        return bool(self.capacity) and queued is not None and queued >= self.capacity

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        key = pending_request.kwargs.get("conversation") if pending_request is not None else None
        if key is None:
            return [random.sample(candidate_replicas, min(2, len(candidate_replicas))), candidate_replicas]
        home_id = self.homes.get(key)
        home = next((r for r in candidate_replicas if r.replica_id == home_id), None) or max(
            candidate_replicas, key=lambda replica: _weight(key, replica))
        others = [r for r in candidate_replicas if r is not home]
        if self._full(home) and others:
            return [others, [home]]
        return [[home], others] if others else [[home]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        key = pending_request.kwargs.get("conversation")
        if key is None:
            return
        self.homes[key] = replica_id
        self.homes.move_to_end(key)
        while len(self.homes) > REMEMBERED:
            self.homes.popitem(last=False)
