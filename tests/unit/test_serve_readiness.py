"""`farm serve` prints "rollout service ready" once /readyz answers 200, never before (rollout_farm/services/serving/
readiness.py). /readyz here is a real HTTP server on 127.0.0.1 that answers as the farm's does (its 503 body: the
replicas' reasons, field "weights" for a committed version no replica can load; tests/service/test_weight_store.py
checks the farm's own); the test switches its answer."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from rollout_farm.services.serving.readiness import announce

LOST = "committed weight version 4 cannot be loaded (it was an upload (bytes), held only in the object store ...)"


@pytest.fixture
def readyz():
    """(url, answer): the server's /readyz answers answer["status"] with answer["detail"]."""
    answer = {"status": 503, "detail": []}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"error": "not ready", "detail": answer["detail"]}).encode()
            self.send_response(answer["status"])
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", answer
    server.shutdown()


def run(url: str, patience_s: float) -> tuple[threading.Thread, threading.Event]:
    done = threading.Event()
    t = threading.Thread(target=announce, args=(url, "http://farm", done, patience_s, 0.02), daemon=True)
    t.start()
    return t, done


def wait_for(capsys, words: str, out: list[str]) -> None:
    for _ in range(500):
        out.append(capsys.readouterr().out)
        if words in "".join(out):
            return
        threading.Event().wait(0.01)
    raise AssertionError(f"never printed {words!r}: {''.join(out)!r}")


def test_a_farm_that_cannot_load_its_weights_says_why_and_what_to_do_and_ready_only_after_a_push(readyz, capsys):
    url, answer = readyz
    answer["detail"] = [{"field": "weights", "message": LOST}]
    t, done = run(url, patience_s=3600)
    out: list[str] = []
    wait_for(capsys, "NOT ready", out)
    threading.Event().wait(0.2)  # several more polls: said once, and never "ready"
    said = "".join(out) + capsys.readouterr().out
    assert said.count("NOT ready") == 1 and LOST in said and "farm serve --fresh" in said
    assert "rollout service ready" not in said
    answer.update(status=200, detail=[])  # a push of version 4 or newer
    t.join(timeout=10)
    assert capsys.readouterr().out == "rollout service ready on http://farm\n" and not done.is_set()


def test_a_replica_catching_up_is_not_reported_before_the_patience_runs_out(readyz, capsys):
    """Negative control: another reason than lost weights is the normal start (a replica loading the committed
    version): nothing is printed within the patience, then the ready line."""
    url, answer = readyz
    answer["detail"] = [{"field": "replica", "message": "replicas serve different weight versions"}]
    t, done = run(url, patience_s=3600)
    threading.Event().wait(0.3)
    assert capsys.readouterr().out == ""
    answer.update(status=200, detail=[])
    t.join(timeout=10)
    assert capsys.readouterr().out == "rollout service ready on http://farm\n"
    answer.update(status=503)
    t, done = run(url, patience_s=3600)  # stopped (SIGTERM) before it is ready: it returns, with no line at all
    done.set()
    t.join(timeout=10)
    assert not t.is_alive() and capsys.readouterr().out == ""
