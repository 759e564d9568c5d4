"""Hosted on a shared server, tried as a hostile or careless client would: real servers on loopback, no mocks."""
from __future__ import annotations

import base64
import io
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import psutil
from PIL import Image

from api import prometheus
from engine import MetricsStore
from engine.records.metrics import RequestMetrics
from server.slot import shutdown

from .test_api import start_server


def _png_data_url(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", optimize=True)
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def _chat(url: str, content, **extra) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", timeout=60,
                      json={"messages": [{"role": "user", "content": content}], "max_tokens": 2, **extra})


def _image_message(image_url: str) -> list:
    return [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": image_url}}]


def test_compressed_image_bombs_are_refused_from_their_headers(tiny_model, tmp_path):
    """Eight 64-megapixel 1-bit PNGs in one small request: refused before any pixel is decoded, memory flat."""
    bomb = _png_data_url(Image.new("1", (8000, 8000)))
    content = [{"type": "text", "text": "What is this?"}] + [{"type": "image_url", "image_url": {"url": bomb}}] * 8
    assert len(str(content)) < 100_000
    process, url = start_server(tiny_model, tmp_path / "api.db", tmp_path / "server.log")
    try:
        server = psutil.Process(process.pid)
        assert _chat(url, "warm up").status_code == 200
        before = server.memory_info().rss

        def send(_):
            started = time.perf_counter()
            response = _chat(url, content)
            return response.status_code, response.json()["error"]["code"], time.perf_counter() - started

        results = [send(i) for i in range(10)]
        with ThreadPoolExecutor(3) as pool:
            results += list(pool.map(send, range(9)))
        assert {(status, code) for status, code, _ in results} == {(400, "invalid_image")}
        assert max(seconds for _, _, seconds in results) < 1.0
        assert server.memory_info().rss - before < 200 * 2**20
        # one such image alone is admitted, decoded at the size the budget allows, and answered
        assert _chat(url, _image_message(bomb)).status_code == 200
        # The engine hands freed memory back once idle, just after the answer leaves: allow it a moment on a busy CPU.
        deadline = time.time() + 5
        while server.memory_info().rss - before >= 200 * 2**20 and time.time() < deadline:
            time.sleep(0.2)
        assert server.memory_info().rss - before < 200 * 2**20
    finally:
        process.terminate()
        process.wait(20)


class ImageHost(BaseHTTPRequestHandler):
    """/slow trickles a byte a second; /redirect-local redirects off the allowed list; /image.png is an image;
    anything else is 404."""

    def do_GET(self):
        if self.path == "/slow":
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.end_headers()
            try:
                for _ in range(30):
                    self.wfile.write(b"\x89")
                    self.wfile.flush()
                    time.sleep(1)
            except OSError:
                pass
        elif self.path == "/redirect-local":
            self.send_response(302)
            self.send_header("Location", f"http://localhost:{self.server.server_address[1]}/image.png")
            self.end_headers()
        elif self.path == "/image.png":
            buffer = io.BytesIO()
            Image.new("RGB", (64, 64), "red").save(buffer, format="PNG")
            self.send_response(200)
            self.send_header("Content-Length", str(len(buffer.getvalue())))
            self.end_headers()
            self.wfile.write(buffer.getvalue())
        else:
            self.send_response(404)
            self.end_headers()

    def log_message(self, *args):
        pass


def test_image_urls_are_fetched_off_the_event_loop_with_a_deadline_and_no_ssrf(tiny_model, tmp_path):
    host = ThreadingHTTPServer(("127.0.0.1", 0), ImageHost)
    threading.Thread(target=host.serve_forever, daemon=True).start()
    port = host.server_address[1]
    process, url = start_server(tiny_model, tmp_path / "api.db", tmp_path / "server.log",
                                VLSCOPE_API_IMAGE_HOSTS="127.0.0.1", VLSCOPE_API_IMAGE_PRIVATE_NETWORKS="on",
                                VLSCOPE_API_IMAGE_FETCH_SECONDS="3")
    guarded, guarded_url = start_server(tiny_model, tmp_path / "guarded.db", tmp_path / "guarded.log",
                                        VLSCOPE_API_IMAGE_HOSTS="localhost,127.0.0.1")
    try:
        assert _chat(url, _image_message(f"http://127.0.0.1:{port}/image.png")).status_code == 200
        with ThreadPoolExecutor(1) as pool:
            slow = pool.submit(_chat, url, _image_message(f"http://127.0.0.1:{port}/slow"))
            time.sleep(1)
            for _ in range(5):  # the whole server answers while the fetch trickles
                started = time.perf_counter()
                assert httpx.get(f"{url}/health", timeout=5).status_code == 200
                assert time.perf_counter() - started < 0.1
                time.sleep(0.2)
            answer = slow.result()
        assert answer.status_code == 400 and answer.json()["error"]["code"] == "image_fetch_failed"

        # a redirect off the list, a refused connection and a 404 all read the same: no port-scan oracle
        texts = set()
        for path in (f"127.0.0.1:{port}/redirect-local", f"127.0.0.1:{port}/missing", "127.0.0.1:1/closed"):
            answer = _chat(url, _image_message(f"http://{path}"))
            assert answer.status_code == 400, path
            texts.add(answer.json()["error"]["message"])
        assert texts == {"could not fetch the image from 127.0.0.1"}
        # without private networks allowed, an allowed host that resolves to loopback is never fetched
        for name in ("localhost", "127.0.0.1"):
            answer = _chat(guarded_url, _image_message(f"http://{name}:{port}/image.png"))
            assert answer.status_code == 400 and answer.json()["error"]["code"] == "image_fetch_failed"
    finally:
        for server in (process, guarded):
            server.terminate()
            server.wait(20)
        host.shutdown()


def test_request_checks_caps_origins_hosts_and_recorded_refusals(tiny_model, tmp_path):
    process, url = start_server(tiny_model, tmp_path / "api.db", tmp_path / "server.log",
                                VLSCOPE_MAX_NEW_TOKENS="32", VLSCOPE_API_ALLOW_IGNORE_EOS="off",
                                VLSCOPE_ALLOWED_ORIGINS="https://tools.example", VLSCOPE_API_KEYS="k-SECRET")
    key = {"Authorization": "Bearer k-SECRET"}
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    endpoint = f"{url}/v1/chat/completions"
    try:
        assert httpx.post(endpoint, json=body, headers=key).status_code == 200
        too_long = httpx.post(endpoint, json=dict(body, max_tokens=33), headers=key)
        assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "max_tokens"
        ignore = httpx.post(endpoint, json=dict(body, ignore_eos=True), headers=key)
        assert ignore.status_code == 400 and ignore.json()["error"]["param"] == "ignore_eos"
        plain = httpx.post(endpoint, content=str(body), headers=dict(key, **{"Content-Type": "text/plain"}))
        assert plain.status_code == 415
        evil = httpx.post(endpoint, json=body, headers=dict(key, Origin="https://evil.example"))
        assert evil.status_code == 403 and evil.json()["error"]["code"] == "origin_not_allowed"
        friend = httpx.post(endpoint, json=body, headers=dict(key, Origin="https://tools.example"))
        assert friend.status_code == 200 and friend.headers["access-control-allow-origin"] == "https://tools.example"
        preflight = httpx.options(endpoint, headers={"Origin": "https://tools.example",
                                                     "Access-Control-Request-Method": "POST"})
        assert preflight.status_code == 204
        rebound = httpx.post(endpoint, json=body, headers=dict(key, Host="attacker.example:8501"))
        assert rebound.status_code == 403 and rebound.json()["error"]["code"] == "host_not_allowed"
        assert httpx.post(endpoint, json=body, headers=dict(key, Host="localhost")).status_code == 200
        assert httpx.post(endpoint, json=body).status_code == 401
        # an upload to the app before sign-in is refused by the server itself (no password here: Streamlit decides)
        assert httpx.put(f"{url}/_stcore/upload_file/not-a-session/file", content=b"x" * 1000).status_code != 401
    finally:
        process.terminate()
        process.wait(20)
    refused = [r for r in MetricsStore(tmp_path / "api.db").recent(50) if r.status == "refused"]
    kinds = sorted(r.error_type for r in refused)
    assert kinds == ["host_not_allowed", "invalid_api_key", "invalid_value", "origin_not_allowed",
                     "unsupported_media_type", "unsupported_parameter"]
    assert all(r.source == "api" and "k-SECRET" not in (r.error or "") for r in refused)


def test_uploads_wait_for_sign_in(tiny_model, tmp_path):
    process, url = start_server(tiny_model, tmp_path / "api.db", tmp_path / "server.log",
                                VLSCOPE_APP_PASSWORD="pw", VLSCOPE_API_KEYS="k")
    try:
        upload = httpx.put(f"{url}/_stcore/upload_file/any-session/file", content=b"x" * 1000)
        assert upload.status_code == 401 and upload.json()["error"]["code"] == "sign_in_required"
    finally:
        process.terminate()
        process.wait(20)


def test_wrong_passwords_lock_out_and_settings_need_an_admin(app_on_tiny, tiny_model, monkeypatch):
    import ui.access

    monkeypatch.setenv("VLSCOPE_APP_PASSWORD", "team")
    monkeypatch.setenv("VLSCOPE_ADMIN_PASSWORD", "boss")
    monkeypatch.setenv("VLSCOPE_SIGN_IN_ATTEMPTS", "2")  # lowered to keep the test short
    ui.access._failures.clear()
    try:
        at = app_on_tiny().run()
        for attempt in ("guess", "guess2"):
            at.text_input(key="sign_in_password").set_value(attempt)
            at.button(key="sign_in_submit").click().run()
            assert "Wrong password." in [e.value for e in at.error]
        at.text_input(key="sign_in_password").set_value("team")
        at.button(key="sign_in_submit").click().run()
        assert any("Too many failed attempts" in e.value for e in at.error)  # even the right one waits now
        ui.access._failures.clear()
        at.text_input(key="sign_in_password").set_value("team")
        at.button(key="sign_in_submit").click().run()
        assert at.chat_input(key="chat_prompt")

        at.switch_page("pages/settings.py").run()
        assert not at.exception
        assert not [w for w in at.text_input if w.key == "set_model"]  # a signed-in user, not an admin
        at.text_input(key="admin_password").set_value("boss")
        at.button(key="admin_submit").click().run()
        assert at.text_input(key="set_model").value == str(tiny_model)
    finally:
        ui.access._failures.clear()


def test_a_lockout_holds_for_that_session_or_address_only(monkeypatch):
    """AppTest runs every session under one id, so the policy is held here: another browser from another address
    signs in while one is locked out; the locked-out address stays locked from a new session too."""
    import ui.access

    monkeypatch.setenv("VLSCOPE_SIGN_IN_ATTEMPTS", "3")
    shutdown()  # the settings are read afresh
    ui.access._failures.clear()
    try:
        attacker = ["session:a", "address:10.9.8.7"]
        for _ in range(3):
            ui.access._record_failure(attacker)
        assert ui.access._locked_for(attacker) > 0
        assert ui.access._locked_for(["session:b", "address:10.1.1.1"]) == 0  # a colleague
        assert ui.access._locked_for(["session:c", "address:10.9.8.7"]) > 0  # the same machine, a new tab
    finally:
        ui.access._failures.clear()
        shutdown()


def test_metrics_scrape_costs_the_same_at_50000_records(tmp_path):
    store = MetricsStore(tmp_path / "m.db")
    base = RequestMetrics(id="x", status="ok", source="api", warmup=False, submitted_at=1.0, finished_at=2.0,
                          model="m", synthetic=True, dtype="float32", threads=2, kv_cache=True, min_pixels=1,
                          max_pixels=2, max_new_tokens=8, temperature=0.0, top_p=1.0, ttft_s=0.2, e2e_s=1.0,
                          stages={"prefill": 0.1, "decode": 0.5})

    def scrape_seconds() -> float:
        started = time.perf_counter()
        text = prometheus.render(store, 0, 0, True)
        assert text.startswith("# HELP")
        return time.perf_counter() - started

    store.add_many([RequestMetrics(**{**base.to_dict(), "id": f"r{i}"}) for i in range(50)])
    scrape_seconds()
    small = min(scrape_seconds() for _ in range(3))
    store.add_many([RequestMetrics(**{**base.to_dict(), "id": f"s{i}"}) for i in range(50_000)])
    scrape_seconds()  # the first scrape after them counts them once
    large = min(scrape_seconds() for _ in range(3))
    assert large < max(5 * small, 0.02)
    assert f'vlscope_requests_total{{status="ok",source="api"}} {50_050}' in prometheus.render(store, 0, 0, True)


def test_an_open_server_says_so_to_admins(app_on_tiny, monkeypatch):
    at = app_on_tiny().run()
    assert any(w.value.startswith("Open to the network") for w in at.sidebar.warning)
    at.switch_page("pages/profiling.py").run()  # refusals are counted by kind there
    assert not at.exception
    shutdown()  # the next app's engine is built from the settings below
    monkeypatch.setenv("VLSCOPE_API_KEYS", "k")
    at = app_on_tiny()
    at.secrets["vlscope"] = {"app_password": "pw"}
    at.run()
    at.text_input(key="sign_in_password").set_value("pw")
    at.button(key="sign_in_submit").click().run()
    assert not any(w.value.startswith("Open to the network") for w in at.sidebar.warning)
