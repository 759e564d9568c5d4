"""The metrics database: concurrent writers, versioned schema, queries, CSV, owner-only file."""
from __future__ import annotations

import csv
import io
import sqlite3
import stat
import threading
import time

import pytest

from engine.records.metrics import RequestMetrics
from engine.records.store import SCHEMA_VERSION, MetricsStore, stage_percentiles, to_csv


def record(i: int, submitted_at: float, **changes) -> RequestMetrics:
    values = dict(
        id=f"r{i}", status="ok", source="test", warmup=False, submitted_at=submitted_at,
        finished_at=submitted_at + 1, model="tiny", synthetic=True, dtype="float32", threads=2, kv_cache=True,
        min_pixels=1, max_pixels=2, max_new_tokens=8, temperature=0.0, top_p=1.0, image_sizes=((10, 20),),
        stages={"preprocess": 0.01 * i, "prefill": 0.1 * i, "decode": 1.0}, token_latencies_s=(0.1, 0.2),
        ttft_s=0.2 * i, e2e_s=1.5 * i, rss_peak_bytes=100 + i,
    )
    values.update(changes)
    return RequestMetrics(**values)


def test_round_trip_and_queries(tmp_path):
    store = MetricsStore(tmp_path / "m.db")
    now = time.time()
    for i in range(1, 11):
        store.add(record(i, now - 100 + i, warmup=(i == 1)))
    assert store.get("r5") == record(5, now - 95)
    assert [m.id for m in store.recent(3)] == ["r10", "r9", "r8"]
    assert len(store.recent(100, include_warmup=False)) == 9
    assert {m.id for m in store.between(now - 93.5, now - 91.5)} == {"r7", "r8"}
    assert stat.S_IMODE((tmp_path / "m.db").stat().st_mode) == 0o600


def test_percentiles_and_csv():
    records = [record(i, 1000.0 + i) for i in range(1, 101)]
    summary = stage_percentiles(records)
    assert summary["prefill"][50] == pytest.approx(5.05)
    assert summary["prefill"][95] == pytest.approx(9.505)
    assert summary["decode"][50] == 1.0
    assert list(summary)[:3] == ["preprocess", "prefill", "decode"]
    rows = list(csv.DictReader(io.StringIO(to_csv(records[:2]))))
    assert rows[1]["id"] == "r2" and float(rows[1]["stage_prefill_s"]) == pytest.approx(0.2)
    assert rows[0]["stage_vision_encode_s"] == ""


def test_many_threads_and_two_connections_write_at_once(tmp_path):
    path = tmp_path / "m.db"
    stores = [MetricsStore(path), MetricsStore(path)]  # as two processes or two sessions would

    def writer(t: int) -> None:
        for i in range(25):
            assert stores[t % 2].add(record(t * 100 + i, float(t * 100 + i)))

    threads = [threading.Thread(target=writer, args=(t,)) for t in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert MetricsStore(path).count() == 200
    assert sqlite3.connect(path).execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_schema_version_is_checked(tmp_path):
    path = tmp_path / "m.db"
    MetricsStore(path)
    assert sqlite3.connect(path).execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    connection = sqlite3.connect(path)
    connection.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    connection.commit()
    with pytest.raises(RuntimeError, match="Upgrade vlscope"):
        MetricsStore(path)


def test_write_failure_is_reported_not_raised(tmp_path):
    store = MetricsStore(tmp_path / "m.db")
    store._connection().execute("DROP TABLE requests")
    assert store.add(record(1, 1.0)) is False
    assert "could not write metrics" in store.last_error
