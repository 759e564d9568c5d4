"""Ray Serve's request router for the replicas: a conversation's follow-ups go to the replica that holds its prefix
cache while that one is not busier than the least-loaded replica by more than a threshold; everything else goes to
the least-loaded replica."""
from __future__ import annotations

import hashlib
import random
from collections import Counter, OrderedDict

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

REMEMBERED = 100_000  # conversations whose replica is remembered; the oldest are forgotten first


def _weight(key: str, replica: RunningReplica) -> int:
    return int.from_bytes(hashlib.blake2b(f"{key}|{replica.replica_id.unique_id}".encode(), digest_size=8).digest())


def ranked(loads: dict[ReplicaID, int], home: ReplicaID | None, threshold: int, capacity: int,
           tie_break) -> list[ReplicaID]:
    """Replicas in the order to try them. The home first while it has room (fewer than `capacity` requests, 0: no
    bound) and its load is at most the least-loaded replica's plus `threshold`; the rest least loaded first, ties
    broken by `tie_break` (higher first)."""
    order = sorted(loads, key=lambda replica: (loads[replica], -tie_break(replica)))
    room = not capacity or loads.get(home, 0) < capacity
    if home in loads and room and loads[home] <= loads[order[0]] + threshold:
        order.remove(home)
        order.insert(0, home)
    return order


class ConversationRouter(RequestRouter):
    """Reads the `conversation` keyword of a replica call (scale/front.py). Load is the requests this router has
    sent a replica and not seen complete: every request reaches the replicas through the one front, so that count
    is exact and current, where Ray's own queue-length probes lag a burst. A new conversation goes to the
    least-loaded replica, ties broken by rendezvous hashing on its key (so equal loads spread and a restarted front
    still finds an idle cluster's homes)."""

    def initialize_state(self, balance_threshold: int = 2, capacity: int = 0, **kwargs) -> None:
        self.threshold, self.capacity = balance_threshold, capacity
        self.homes: OrderedDict[str, ReplicaID] = OrderedDict()
        self.loads: Counter[ReplicaID] = Counter()
        self.running: dict[str, ReplicaID] = {}  # Ray's id of each routed request not yet completed

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        key = pending_request.kwargs.get("conversation") if pending_request is not None else None
        by_id = {replica.replica_id: replica for replica in candidate_replicas}
        noise = {replica_id: random.random() for replica_id in by_id}
        tie_break = (lambda replica_id: _weight(key, by_id[replica_id])) if key else noise.__getitem__
        order = ranked({replica_id: self.loads[replica_id] for replica_id in by_id},
                       self.homes.get(key) if key else None, self.threshold, self.capacity, tie_break)
        return [[by_id[order[0]]], [by_id[replica_id] for replica_id in order[1:]]] if len(order) > 1 else [
            [by_id[order[0]]]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        self.running[pending_request.metadata.internal_request_id] = replica_id
        self.loads[replica_id] += 1
        key = pending_request.kwargs.get("conversation")
        if key is None:
            return
        self.homes[key] = replica_id
        self.homes.move_to_end(key)
        while len(self.homes) > REMEMBERED:
            self.homes.popitem(last=False)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        # Ray also reports requests a replica refused, which were never routed.
        if self.running.pop(internal_request_id, None) is None:
            return
        if self.loads[replica_id] > 1:
            self.loads[replica_id] -= 1
        else:
            del self.loads[replica_id]

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.loads.pop(replica_id, None)
        self.running = {request: replica for request, replica in self.running.items() if replica != replica_id}
