"""An OpenAI-style backend gone bad, for `VLSCOPE_REMOTE_URL`: answers that parse but carry what a record, a chart
or a client must not take as it is (metrics of the wrong type, stage names with markup, usage as text, content as
a number, an image that would make every viewer's browser call out). The prompt picks the answer; any other
prompt gets one of them in turn. Used by `python -m bench.soak --hostile` and the remote tests."""
from __future__ import annotations

import itertools
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

TEXT = {"choices": [{"delta": {"content": "fine"}}]}
HOSTILE_ANSWERS = {
    "metrics list": dict(TEXT, metrics=[1, 2]),
    "stages string": dict(TEXT, metrics={"stages": "abc", "vision_tokens": "many"}),
    "stage names": dict(TEXT, metrics={"stages": {"<a href='http://x'>s</a>": 1.0, "prefill": 0.5}}),
    "usage strings": dict(TEXT, usage={"prompt_tokens": "abc", "completion_tokens": None}),
    "content number": {"choices": [{"delta": {"content": 5}}]},
    "tracking image": {"choices": [{"delta": {"content": "![t](http://tracker.invalid/pixel.png)"}}]},
}
# Answers an OpenAI-style server must not send at all: each ends its request with an error.
BROKEN_LINES = {"malformed": "data: {not json", "string error": 'data: {"error": "boom"}',
                "list": "data: [1, 2]", "choices": 'data: {"choices": ["x"]}'}


class HostileBackend(BaseHTTPRequestHandler):
    turns = itertools.cycle(HOSTILE_ANSWERS)

    def do_GET(self):
        self._send(200, "application/json", json.dumps({"data": [{"id": "hostile"}]}).encode())

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        content = body["messages"][-1]["content"]
        prompt = content if isinstance(content, str) else next(
            (part.get("text") for part in content if isinstance(part, dict) and part.get("type") == "text"), "")
        if prompt == "slow":
            time.sleep(2)
            line = 'data: {"choices": [{"delta": {"content": "late"}}]}'
        elif prompt in BROKEN_LINES:
            line = BROKEN_LINES[prompt]
        else:
            line = "data: " + json.dumps(HOSTILE_ANSWERS.get(prompt) or HOSTILE_ANSWERS[next(self.turns)])
        self._send(200, "text/event-stream", f"{line}\n\ndata: [DONE]\n\n".encode())

    def _send(self, status, kind, payload):
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args):
        pass


def serve() -> tuple[ThreadingHTTPServer, str]:
    """Start the backend on a free loopback port, in a thread; returns it and its /v1 URL."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), HostileBackend)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/v1"
