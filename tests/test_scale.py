"""Scale-out on Ray Serve for real: `python -m scale` starts a one-node cluster on loopback with two replicas of the
tiny model; requests go over HTTP through Ray's proxy and the front, as a client's would. No mocks."""
from __future__ import annotations

import base64
import ipaddress
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest

from bench.scale import start_cluster, stop_cluster
from scale.conversation import SESSION_HEADER, conversation_key
from scale.metrics import cluster_metrics

from .conftest import ROOT

ray = pytest.importorskip("ray", reason="the optional requirements (requirements-scale.txt) are not installed")
KEY = "cluster-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


def test_a_conversation_is_named_by_its_session_its_user_or_its_first_picture():
    picture = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    first = {"messages": [{"role": "user", "content": [picture, {"type": "text", "text": "What is it?"}]}]}
    follow_up = {"messages": first["messages"] + [{"role": "assistant", "content": "A cat."},
                                                   {"role": "user", "content": "Which colour?"}]}
    as_bytes = lambda body: json.dumps(body).encode()  # noqa: E731
    assert conversation_key({}, as_bytes(first)) == conversation_key({}, as_bytes(follow_up)) is not None
    other = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,B"}}]}]}
    assert conversation_key({}, as_bytes(other)) != conversation_key({}, as_bytes(first))
    assert conversation_key({}, as_bytes(first | {"user": "ann"})) == "user:ann"
    assert conversation_key({SESSION_HEADER: "s1"}, as_bytes(first | {"user": "ann"})) == "session:s1"
    text_only = {"messages": [{"role": "user", "content": "hello"}]}
    assert conversation_key({}, as_bytes(text_only)).startswith("start:")
    assert conversation_key({}, b"not json") is None and conversation_key({}, b"[1]") is None


def test_the_replicas_metrics_merge_into_one_text_labelled_by_replica():
    text = ('# HELP vlscope_queue_depth Requests.\n# TYPE vlscope_queue_depth gauge\nvlscope_queue_depth 2\n'
            '# HELP vlscope_requests_total R.\n# TYPE vlscope_requests_total counter\n'
            'vlscope_requests_total{status="ok",source="api"} 3\n')
    merged = cluster_metrics([{"replica": "a", "metrics": text}, {"replica": "b", "metrics": text}])
    assert merged.count("# TYPE vlscope_queue_depth gauge") == 1 and "vlscope_replicas 2" in merged
    assert 'vlscope_queue_depth{replica="a"} 2' in merged and 'vlscope_queue_depth{replica="b"} 2' in merged
    assert 'vlscope_requests_total{replica="b",status="ok",source="api"} 3' in merged
    from prometheus_client.parser import text_string_to_metric_families
    assert len(list(text_string_to_metric_families(merged))) == 3  # valid Prometheus text


def test_the_command_refuses_flags_that_do_not_fit():
    for flags in (["--min-replicas", "2"], ["--min-replicas", "3", "--max-replicas", "2"], ["--threads", "0"]):
        run = subprocess.run([sys.executable, "-m", "scale", *flags], cwd=ROOT, capture_output=True, text=True,
                             timeout=60)
        assert run.returncode == 2 and "error:" in run.stderr, flags


@pytest.fixture(scope="module")
def cluster(tiny_model, tmp_path_factory):
    folder = tmp_path_factory.mktemp("cluster")
    # RAY_ADDRESS names a cluster that is not there: the command starts its own all the same.
    env = dict(VLSCOPE_MODEL=str(tiny_model), VLSCOPE_DB=str(folder / "vlscope.db"), VLSCOPE_WARMUP="off",
               VLSCOPE_COMPILE="off", VLSCOPE_API_KEYS=KEY, VLSCOPE_MAX_BATCH="1", VLSCOPE_MAX_QUEUE="0",
               VLSCOPE_MAX_NEW_TOKENS="6000", VLSCOPE_API_ALLOW_IGNORE_EOS="true", RAY_ADDRESS="127.0.0.1:9")
    process, url = start_cluster(2, 1, env, folder / "scale.log", KEY, timeout_s=240)
    yield url, process, folder
    stop_cluster(process)


def ask(url: str, messages, max_tokens: int = 4, headers: dict | None = None, **body) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", headers=AUTH | (headers or {}), timeout=60,
                      json={"messages": messages, "max_tokens": max_tokens, **body})


def replicas(url: str) -> dict[str, int]:
    """Each live replica's id and process id."""
    return {r["replica"]: r["pid"] for r in httpx.get(f"{url}/health", headers=AUTH, timeout=10).json()["replicas"]}


def test_the_command_starts_its_own_cluster_whatever_ray_address_says_and_names_it(cluster):
    _, _, folder = cluster
    said = (folder / "scale.log").read_text()
    assert "Ray cluster: a new one on this machine (127.0.0.1:" in said
    assert f"Records of every replica: {folder / 'vlscope.db'} on the head node" in said
    started = time.perf_counter()
    run = subprocess.run([sys.executable, "-m", "scale", "--address", "127.0.0.1:9"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 1 and time.perf_counter() - started < 30
    assert "no Ray cluster answers at --address 127.0.0.1:9" in run.stderr and "Traceback" not in run.stderr


def test_the_cluster_listens_on_loopback_only_and_asks_for_the_key(cluster):
    url, process, _ = cluster
    listening = set()
    for proc in [psutil.Process(process.pid), *psutil.Process(process.pid).children(recursive=True)]:
        try:
            listening |= {(conn.laddr.ip, conn.laddr.port) for conn in proc.net_connections("inet")
                          if conn.status == psutil.CONN_LISTEN}
        except psutil.NoSuchProcess:
            continue
    def loopback(ip: str) -> bool:
        address = ipaddress.ip_address(ip)
        return (getattr(address, "ipv4_mapped", None) or address).is_loopback
    assert len(listening) > 5 and all(loopback(ip) for ip, _ in listening), listening
    refused = httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{url}/health").json() == {"status": "ready"}  # details only with the key


def test_two_replica_processes_answer_and_a_stream_arrives_in_pieces(cluster):
    url, _, _ = cluster
    pids = replicas(url)
    assert len(set(pids.values())) == 2
    answered = set()
    for turn in range(16):
        answer = ask(url, [{"role": "user", "content": f"hello number {turn}"}])
        assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"]
        answered.add(answer.headers["x-vlscope-replica"])
        if len(answered) == 2:
            break
    assert answered == set(pids)
    arrivals, started = [], time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/chat/completions", headers=AUTH, timeout=60,
                      json={"messages": [{"role": "user", "content": "count"}], "max_tokens": 300,
                            "ignore_eos": True, "stream": True}) as stream:
        assert stream.headers["content-type"].startswith("text/event-stream")
        for line in stream.iter_lines():
            if line.startswith("data: {") and '"content"' in line:
                arrivals.append(time.perf_counter() - started)
    assert len(arrivals) >= 100 and arrivals[-1] - arrivals[0] > 0.2  # many chunks, sent as they decode


def test_a_follow_up_goes_to_the_replica_of_its_first_turn_and_hits_its_prefix_cache(cluster, images_dir):
    url, _, _ = cluster
    picture = "data:image/png;base64," + base64.b64encode((images_dir / "page.png").read_bytes()).decode()
    history = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": picture}},
                                            {"type": "text", "text": "Read the text"}]}]
    first = ask(url, history)
    home = first.headers["x-vlscope-replica"]
    for turn in range(3):
        history += [{"role": "assistant", "content": first.json()["choices"][0]["message"]["content"]},
                    {"role": "user", "content": f"And then, {turn}?"}]
        follow_up = ask(url, history)
        assert follow_up.status_code == 200 and follow_up.headers["x-vlscope-replica"] == home
        assert follow_up.json()["metrics"]["cached_prompt_tokens"] > 0  # the picture's encoding was not redone
        first = follow_up
    # A client's own session header keeps its requests together, whatever they say.
    homes = {ask(url, [{"role": "user", "content": f"topic {n}"}], headers={SESSION_HEADER: "desk-7"}
                 ).headers["x-vlscope-replica"] for n in range(5)}
    assert len(homes) == 1


def _hold(url: str, results: list, index: int, content: str | None = None, headers: dict | None = None) -> None:
    """A long stream; its replica and first words go into results[index], with each line's arrival; it ends when
    the test closes it."""
    with httpx.stream("POST", f"{url}/v1/chat/completions", headers=AUTH | (headers or {}), timeout=60,
                      json={"messages": [{"role": "user", "content": content or f"long {index}"}], "max_tokens": 6000,
                            "ignore_eos": True, "stream": True}) as stream:
        results[index] = {"status": stream.status_code, "replica": stream.headers.get("x-vlscope-replica"),
                          "lines": [], "arrivals": []}
        for line in stream.iter_lines():
            results[index]["lines"].append(line)
            results[index]["arrivals"].append(time.perf_counter())
            if results[index].get("close") or len(results[index]["lines"]) > 20_000:
                return


def _started(results: list, index: int, lines: int = 1, timeout_s: float = 20) -> dict:
    deadline = time.time() + timeout_s
    while (results[index] is None or len(results[index]["lines"]) < lines) and time.time() < deadline:
        time.sleep(0.05)
    return results[index]


def test_a_conversation_stays_home_while_that_pays_and_moves_when_it_does_not():
    from scale.router import ranked
    even = {"a": 0, "b": 0}.get
    assert ranked({"a": 2, "b": 0}, "a", 2, 0, even)[0] == "a"  # two more than the idlest: the cache still pays
    assert ranked({"a": 3, "b": 0}, "a", 2, 0, even) == ["b", "a"]  # beyond the threshold: balance
    assert ranked({"a": 1, "b": 0}, "a", 2, 1, even)[0] == "b"  # home full (its batch and queue)
    assert ranked({"a": 1, "b": 0}, None, 2, 0, even)[0] == "b"  # a new conversation: the least loaded
    assert ranked({"a": 0, "b": 0}, None, 2, 0, {"a": 1, "b": 5}.get)[0] == "b"  # equal loads: its hash picks


def test_identical_requests_at_once_go_to_different_replicas(cluster):
    url, _, _ = cluster
    results = [None] * 2
    with ThreadPoolExecutor(2) as pool:
        for index in range(2):  # the same words: the same conversation key
            pool.submit(_hold, url, results, index, "the same question")
            _started(results, index)
        assert [r["status"] for r in results] == [200, 200]
        assert results[0]["replica"] != results[1]["replica"]
        for result in results:
            result["close"] = True
    time.sleep(1)  # the replicas notice the closed streams


def _declared_200_mb_sent_1_mb(url: str) -> bytes:
    import socket
    with socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=15) as sock:
        sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
                     "Content-Type: application/json\r\nContent-Length: 200000000\r\n\r\n".encode() + b" " * 1_000_000)
        reply = b""
        while not reply.endswith(b"}") and (part := sock.recv(4096)):  # the head, then the JSON error
            reply += part
        return reply


def _post_raw(url: str, body: bytes) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", headers=AUTH | {"content-type": "application/json"}, content=body,
                      timeout=60)


def test_the_front_refuses_by_declared_size_at_once_and_no_body_pauses_another_stream(cluster):
    url, _, _ = cluster
    results = [None]
    steps = {  # each body, and the longest pause it may cause another client's stream
        "declared 200 MB, sent 1 MB": (lambda: _declared_200_mb_sent_1_mb(url), 0.1),
        "24 MB of empty objects": (lambda: _post_raw(url, b'{"messages": [' + b"{}," * 8_000_000 + b'{}]}'), 0.1),
        # Ray's proxy, the front and a replica each take a copy of a large valid body on the same two cores.
        "24 MB of text": (lambda: _post_raw(url, json.dumps({"messages": [{"role": "user",
                                                                           "content": "word " * 4_800_000}]}).encode()),
                          0.25),
    }
    seen = {}
    with ThreadPoolExecutor(1) as pool:
        pool.submit(_hold, url, results, 0)
        _started(results, 0, lines=50)
        for name, (send, _) in steps.items():
            started = time.perf_counter()
            reply = send()
            seen[name] = (started, time.perf_counter(), reply)
            time.sleep(0.3)
        results[0]["close"] = True
    declared, empty, text = (seen[name][2] for name in steps)
    assert declared.startswith(b"HTTP/1.1 413") and b"body_too_large" in declared
    assert seen["declared 200 MB, sent 1 MB"][1] - seen["declared 200 MB, sent 1 MB"][0] < 5
    assert empty.status_code == 400 and empty.json()["error"]["code"] == "body_too_complex"
    assert text.status_code in (400, 429) and "error" in text.json()
    for name, (began, ended, _) in seen.items():
        arrivals = [t for t in results[0]["arrivals"] if began <= t <= ended + 0.3]
        longest = max(later - earlier for earlier, later in zip(arrivals, arrivals[1:]))
        print(f"{name}: answered in {ended - began:.3f} s; the other stream's longest pause {longest:.3f} s")
        assert len(arrivals) > 10 and longest < steps[name][1], f"{name}: another stream paused {longest:.3f} s"
    time.sleep(1)


def test_a_full_cluster_answers_429_at_once_and_never_holds_a_request(cluster):
    url, _, _ = cluster
    results = [None] * 6
    with ThreadPoolExecutor(6) as pool:
        running = []
        for index in range(6):  # each replica takes one answer (VLSCOPE_MAX_BATCH=1, no queue)
            pool.submit(_hold, url, results, index)
            deadline = time.time() + 20
            while results[index] is None and time.time() < deadline:
                time.sleep(0.05)
            if results[index]["status"] == 200:
                running.append(index)
            if len({results[i]["replica"] for i in running}) == 2:
                break
        assert len({results[i]["replica"] for i in running}) == 2
        started = time.perf_counter()
        refused = ask(url, [{"role": "user", "content": "one more"}])
        assert refused.status_code == 429 and int(refused.headers["retry-after"]) > 0
        assert refused.json()["error"]["code"] == "busy" and time.perf_counter() - started < 10
        for index in running:
            results[index]["close"] = True
    # The replicas notice the closed streams within a few seconds; a client honouring Retry-After then gets in.
    deadline = time.time() + 15
    while (after := ask(url, [{"role": "user", "content": "after"}])).status_code == 429 and time.time() < deadline:
        time.sleep(min(1.0, int(after.headers["retry-after"])))
    assert after.status_code == 200


def test_metrics_show_every_replica_and_the_app_fronting_the_cluster_answers(cluster, monkeypatch, tmp_path):
    from streamlit.testing.v1 import AppTest

    from server.slot import shutdown
    from ui.replicas import replica_rows
    url, _, _ = cluster
    time.sleep(2)  # a report from each replica since the last requests
    text = httpx.get(f"{url}/metrics", headers=AUTH, timeout=10).text
    rows = {row["replica"]: row for row in replica_rows(text)}
    assert set(rows) == set(replicas(url)) and all(row["RSS GiB"] > 0.1 for row in rows.values())
    assert sum(row["requests"] for row in rows.values()) > 10 and all("ttft s" in row for row in rows.values())
    assert httpx.get(f"{url}/metrics", timeout=10).status_code == 401

    monkeypatch.setenv("VLSCOPE_REMOTE_URL", f"{url}/v1")
    monkeypatch.setenv("VLSCOPE_REMOTE_API_KEY", KEY)
    monkeypatch.setenv("VLSCOPE_DB", str(tmp_path / "app.db"))
    shutdown()
    try:
        at = AppTest.from_file(str(ROOT / "streamlit_app.py"), default_timeout=120).run()
        at.chat_input(key="chat_prompt").set_value("Hello there").run()
        assert not at.exception
        answer = [m for m in at.chat_message if m.name == "assistant"][0]
        assert answer.markdown[0].value.strip() and "TTFT" in answer.caption[0].value
        at.switch_page("pages/profiling.py").run()
        assert not at.exception and any(h.value == "Replicas (2)" for h in at.subheader)
        assert any(h.value == "Every request the cluster served" for h in at.subheader)
        tables = [table.value for table in at.dataframe]
        assert any("replica" in table.columns and table["replica"].nunique() == 2 for table in tables)
    finally:
        shutdown()


def test_a_replica_killed_mid_answer_ends_that_stream_clearly_and_ray_replaces_it(cluster):
    url, _, _ = cluster
    before = replicas(url)
    results = [None]
    with ThreadPoolExecutor(1) as pool:
        pool.submit(_hold, url, results, 0)
        deadline = time.time() + 20
        while (results[0] is None or len(results[0]["lines"]) < 10) and time.time() < deadline:
            time.sleep(0.05)
        victim = results[0]["replica"]
        os.kill(before[victim], signal.SIGKILL)
    lines = [line for line in results[0]["lines"] if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2][len("data: "):])["error"]
    assert error["code"] == "replica_lost" and "ask again" in error["message"]
    for turn in range(4):  # the next requests go to the replica that lives
        answer = ask(url, [{"role": "user", "content": f"still there {turn}?"}])
        assert answer.status_code == 200 and answer.headers["x-vlscope-replica"] != victim
    deadline = time.time() + 120
    while time.time() < deadline:
        now = replicas(url)
        if len(now) == 2 and victim not in now:
            break
        time.sleep(1)
    else:
        pytest.fail(f"Ray did not replace the killed replica: {replicas(url)}")


def test_one_store_holds_every_replica_s_records_the_lost_answer_among_them(cluster):
    from engine.records.store import MetricsStore
    url, _, folder = cluster
    now = replicas(url)
    deadline = time.time() + 60  # the heir joins the routing once Ray has seen it healthy
    served = set()
    while not set(now) <= served and time.time() < deadline:  # the replacement replica answers some too
        served.add(ask(url, [{"role": "user", "content": f"spread {len(served)} {time.time()}"}]
                       ).headers["x-vlscope-replica"])
    assert set(now) <= served
    time.sleep(1)
    assert httpx.get(f"{url}/metrics/records", timeout=10).status_code == 401
    answer = httpx.get(f"{url}/metrics/records", params={"since": 0}, headers=AUTH, timeout=10).json()
    records = answer["records"]
    assert answer["total"] == len(records) > 20
    by_replica = {record["replica"] for record in records}
    assert set(now) < by_replica and len(by_replica) == 3  # the first two, the killed one among them, and its heir
    lost = [record for record in records if record["status"] == "replica_lost"]
    assert len(lost) == 1 and lost[0]["replica"] not in now and "stopped" in lost[0]["error"]
    # The same store is the file VLSCOPE_DB names, for python -m bench and any SQLite reader; no file per replica.
    store = MetricsStore(folder / "vlscope.db")
    assert store.count() == len(records) and not list(folder.glob("vlscope-*.db"))
    assert {record.id for record in store.recent(10_000)} == {record["id"] for record in records}
