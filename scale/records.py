"""The cluster's one record store: an actor on the head node writes every replica's records into the database
VLSCOPE_DB names there; a replica sends it each record as it writes its own scratch copy (which its /metrics
reads), and the front relabels the running records of a replica that died."""
from __future__ import annotations

import dataclasses
import logging
import tempfile
from pathlib import Path

import ray

from engine.records.metrics import RequestMetrics
from engine.records.stages import REPLICA_LOST, RUNNING
from engine.records.store import MetricsStore, open_store

log = logging.getLogger("vlscope.scale")
ACTOR = "vlscope-records"
NAMESPACE = "vlscope"
HEAD_NODE = "node:__internal_head__"  # the resource only the head node has
ACK_S = 10.0  # how long a replica waits for the store to take a final record before its answer ends
LOST = "the replica answering this request stopped before it finished"


class ClusterRecords:
    """A Ray actor (made one in `start_records`): the cluster's MetricsStore, for replicas to write and the front
    and tools to read. Records travel as dicts (RequestMetrics.to_dict)."""

    def __init__(self, engine_config):
        self.store = open_store(engine_config)

    def path(self) -> str:
        return str(self.store.path.resolve())

    def add_many(self, records: list[dict]) -> bool:
        return self.store.add_many([RequestMetrics.from_dict(record) for record in records])

    def lost(self, replica: str) -> int:
        """The running records of a replica that died become replica_lost; returns how many."""
        return self.store.relabel_running(lambda record: record.replica == replica, REPLICA_LOST, LOST)

    def between(self, since: float, until: float | None = None, limit: int | None = None) -> list[dict]:
        return [record.to_dict() for record in self.store.between(since, until, limit=limit)]

    def count_since(self, since: float) -> int:
        return self.store.count_since(since)


def start_records(engine_config) -> ray.actor.ActorHandle:
    """The store's actor, on the head node, living as long as the process that starts it (`python -m scale`)."""
    actor = ray.remote(ClusterRecords).options(
        name=ACTOR, namespace=NAMESPACE, num_cpus=0, max_restarts=-1, max_task_retries=-1,
        resources={HEAD_NODE: 0.001})
    return actor.remote(engine_config.replace(db_path=str(Path(engine_config.db_path).resolve())))


def cluster_records() -> ray.actor.ActorHandle:
    return ray.get_actor(ACTOR, namespace=NAMESPACE)


def scratch_path(replica: str) -> Path:
    """Where a replica keeps its own copy of its records: its /metrics counts them; the cluster's store keeps them."""
    return Path(tempfile.gettempdir()) / f"vlscope-replica-{replica}.db"


def remove_scratch(replica: str) -> None:
    for suffix in ("", "-wal", "-shm"):
        Path(f"{scratch_path(replica)}{suffix}").unlink(missing_ok=True)


class ReplicaRecords(MetricsStore):
    """A replica's store: its scratch file, and every record sent on to the cluster's store, stamped with the
    replica's id. A final record is in the cluster's store before the answer's last event is sent (Trace.finish
    stores first), so a replica that dies after answering loses nothing."""

    def __init__(self, replica: str, cluster: ray.actor.ActorHandle):
        super().__init__(scratch_path(replica))
        self.replica, self.cluster = replica, cluster

    def add_many(self, records: list[RequestMetrics]) -> bool:
        records = [dataclasses.replace(record, replica=self.replica) for record in records]
        written = super().add_many(records)
        sent = self.cluster.add_many.remote([record.to_dict() for record in records])
        if any(record.status != RUNNING for record in records):
            try:
                ray.get(sent, timeout=ACK_S)
            except Exception as exc:  # the store's actor restarting: the scratch copy still has it
                log.warning("the cluster's record store did not take %d records in %g s: %s", len(records), ACK_S,
                            exc)
        return written

