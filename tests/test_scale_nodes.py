"""The cluster as a team runs it: across two Ray nodes (a head and a worker, on loopback), and scaling with its load.
`python -m scale` joins the nodes with --address as it would join machines; requests go over HTTP. No mocks."""
from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from bench.scale import start_cluster, stop_cluster

from .test_scale import AUTH, KEY, _hold, _started, ask

ray = pytest.importorskip("ray", reason="the optional requirements (requirements-scale.txt) are not installed")


def health(url: str) -> list[dict]:
    return httpx.get(f"{url}/health", headers=AUTH, timeout=10).json().get("replicas", [])


def cluster_records(url: str) -> dict[str, dict]:
    answer = httpx.get(f"{url}/metrics/records", params={"since": 0}, headers=AUTH, timeout=10).json()
    return {record["id"]: record for record in answer["records"]}


@pytest.fixture(scope="module")
def two_nodes(tiny_model, tmp_path_factory):
    from .ray_nodes import RayNodes
    folder = tmp_path_factory.mktemp("two-nodes")
    nodes = RayNodes()
    env = dict(VLSCOPE_MODEL=str(tiny_model), VLSCOPE_DB=str(folder / "vlscope.db"), VLSCOPE_WARMUP="off",
               VLSCOPE_COMPILE="off", VLSCOPE_API_KEYS=KEY, VLSCOPE_MAX_BATCH="4", VLSCOPE_MAX_QUEUE="4",
               VLSCOPE_MAX_NEW_TOKENS="6000", VLSCOPE_API_ALLOW_IGNORE_EOS="true",
               VLSCOPE_SCALE_BALANCE_THRESHOLD="1")
    try:
        process, url = start_cluster(2, 1, env, folder / "scale.log", KEY, timeout_s=240,
                                     flags=("--address", nodes.address))
    except Exception:
        nodes.stop()
        raise
    yield url, nodes, folder
    stop_cluster(process)
    nodes.stop()


def test_the_command_joins_the_nodes_and_places_a_replica_on_each(two_nodes):
    url, nodes, folder = two_nodes
    assert f"Ray cluster: joined {nodes.address} (2 nodes, 2 CPUs)" in (folder / "scale.log").read_text()
    assert len({replica["node_id"] for replica in health(url)}) == 2


def test_one_session_sending_several_at_once_is_spread_beyond_the_threshold(two_nodes):
    url, _, _ = two_nodes
    results = [None] * 4
    with ThreadPoolExecutor(4) as pool:
        for index in range(4):  # one session: its home takes more only while it holds at most one more (threshold 1)
            pool.submit(_hold, url, results, index, None, {"x-session-id": "desk-9"})
            _started(results, index)
        homes = [result["replica"] for result in results]
        assert all(result["status"] == 200 for result in results)
        for result in results:
            result["close"] = True
    assert len(set(homes)) == 2, homes  # today's router sent all four to one replica (it had room for eight)
    time.sleep(1)


def test_a_worker_node_killed_mid_answer_heals_on_the_head_and_loses_no_record(two_nodes):
    url, nodes, _ = two_nodes
    head = httpx.get(f"{url}/health", headers=AUTH, timeout=10).json()["front_node_id"]  # the front: on the head
    answered = [ask(url, [{"role": "user", "content": f"before {n}"}]) for n in range(4)]
    assert all(answer.status_code == 200 for answer in answered)
    on_worker = next(r["replica"] for r in health(url) if r["node_id"] != head)
    results = [None] * 8
    with ThreadPoolExecutor(8) as pool:
        index = 0
        for index in range(8):  # streams until one runs on the worker node's replica
            pool.submit(_hold, url, results, index)
            if _started(results, index, lines=5)["replica"] == on_worker:
                break
        assert results[index]["replica"] == on_worker
        nodes.kill_worker()
        killed = time.time()
        while "data: [DONE]" not in results[index]["lines"][-3:] and time.time() < killed + 45:
            time.sleep(0.1)
        print(f"the stream on the killed node ended {time.time() - killed:.1f} s after the kill")

        for result in results[:index]:
            result["close"] = True
    data = [line for line in results[index]["lines"] if line.startswith("data: ")]
    assert data[-1] == "data: [DONE]", (len(results[index]["lines"]), data[-3:])
    assert json.loads(data[-2][6:])["error"]["code"] == "replica_lost"
    lost_id = json.loads(next(line for line in results[index]["lines"] if line.startswith("data: {"))[6:])["id"]
    after = [ask(url, [{"role": "user", "content": f"after {n}"}]) for n in range(4)]
    assert all(answer.status_code == 200 and answer.headers["x-vlscope-replica"] != on_worker for answer in after)
    deadline = time.time() + 30
    while {r["node_id"] for r in health(url)} != {head} and time.time() < deadline:
        time.sleep(1)
    assert [r["node_id"] for r in health(url)] == [head]  # the replica that is left, on the node that is left
    time.sleep(1)
    records = cluster_records(url)
    for answer in answered + after:  # every answer before and after, whichever node served it
        assert records[answer.json()["id"].removeprefix("chatcmpl-")]["status"] == "ok"
    lost = records[lost_id.removeprefix("chatcmpl-")]
    assert lost["status"] == "replica_lost" and lost["replica"] == on_worker


def test_a_queue_that_builds_brings_a_second_replica_and_an_idle_one_goes_back(tiny_model, tmp_path):
    env = dict(VLSCOPE_MODEL=str(tiny_model), VLSCOPE_DB=str(tmp_path / "vlscope.db"), VLSCOPE_WARMUP="off",
               VLSCOPE_COMPILE="off", VLSCOPE_API_KEYS=KEY, VLSCOPE_MAX_BATCH="2", VLSCOPE_MAX_QUEUE="2",
               VLSCOPE_MAX_NEW_TOKENS="6000", VLSCOPE_API_ALLOW_IGNORE_EOS="true",
               VLSCOPE_SCALE_UPSCALE_DELAY_S="1", VLSCOPE_SCALE_DOWNSCALE_DELAY_S="2",
               RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S="0.5",
               RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S="0.5")
    process, url = start_cluster(1, 1, env, tmp_path / "scale.log", KEY, timeout_s=240,
                                 flags=("--min-replicas", "1", "--max-replicas", "2"))
    try:
        stop = threading.Event()
        statuses = []

        def hold(index: int) -> None:  # two answer, two wait in the queue (headers come when an answer begins)
            with httpx.stream("POST", f"{url}/v1/chat/completions", headers=AUTH, timeout=120,
                              json={"messages": [{"role": "user", "content": f"long {index}"}], "max_tokens": 6000,
                                    "ignore_eos": True, "stream": True}) as stream:
                statuses.append(stream.status_code)
                for _ in stream.iter_lines():
                    if stop.is_set():
                        return

        with ThreadPoolExecutor(4) as pool:
            for index in range(4):  # four answers at once: twice the two a replica is meant to hold
                pool.submit(hold, index)
            began = time.time()
            while len(health(url)) < 2 and time.time() < began + 90:
                time.sleep(0.5)
            grew = time.time() - began
            stop.set()
        assert len(health(url)) == 2, "no second replica came"
        ended = time.time()
        while len(health(url)) > 1 and time.time() < ended + 90:
            time.sleep(0.5)
        print(f"a second replica ready {grew:.1f} s after the queue built; back to one {time.time() - ended:.1f} s "
              "after the answers ended")
        assert statuses == [200] * 4
        assert len(health(url)) == 1, "the idle replica stayed"
        assert ask(url, [{"role": "user", "content": "still here?"}]).status_code == 200
    finally:
        stop_cluster(process)
