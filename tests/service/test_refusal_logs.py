"""Expected refusals are logged as one WARNING line, with no traceback in any process (issue 27): a push the replicas
refuse (both engine replicas logged Serve's "Request failed." traceback for each), an upload the client cuts off
(the ingress logged ClientDisconnect as an unhandled 500, with its traceback), and the torch engine's NCCL verbs (a
documented 501, logged by both replicas with a traceback and by the ingress as an error).

The logs are read where Ray writes them for this test session's cluster: the replicas' Serve logs and their workers'
stderr (the farm's JSON lines), only what was appended during the test.
"""

import socket
import time
from pathlib import Path

import httpx
import ray
from safetensors.torch import load_file, save

from tests.service.helpers import AUTH, push, versions

TRACEBACKS = ("Traceback (most recent call last)", "Request failed")


class Logs:
    """The bytes appended to the Ray session's log files since this object was made."""

    def __init__(self):
        self.folder = Path(ray._private.worker.global_worker.node.get_logs_dir_path())
        self.sizes = {f: f.stat().st_size for f in self.files()}

    def files(self) -> list[Path]:
        return [f for f in self.folder.rglob("*") if f.is_file() and f.suffix in (".log", ".err", ".out")]

    def new(self) -> str:
        out = []
        for f in self.files():
            with open(f, "rb") as fh:
                fh.seek(self.sizes.get(f, 0))
                out.append(fh.read().decode("utf-8", "replace"))
        return "".join(out)

    def wait_for(self, line: str, count: int, timeout_s: float = 30.0) -> str:
        """The new text once `line` appears `count` times in it (workers flush their output in their own time), and
        a second more, so a traceback logged with it would be in it too."""
        deadline = time.monotonic() + timeout_s
        while self.new().count(line) < count and time.monotonic() < deadline:
            time.sleep(0.5)
        time.sleep(1.0)
        return self.new()


def refused(text: str) -> list[str]:
    return [line for line in text.splitlines() if any(t in line for t in TRACEBACKS)]


def test_a_refused_push_logs_one_warning_line_and_no_traceback(service, tiny_model):
    state = load_file(tiny_model / "model.safetensors")
    name = "model.layers.0.self_attn.q_proj.weight"
    state[name] = state[name].clone()
    state[name][0, 0] = float("nan")
    logs = Logs()
    r = push(service, save(state), versions(service)["version"] + 1)
    assert r.status_code == 422 and "NaN" in r.text, r.text  # both replicas refused it at staging
    text = logs.wait_for('"weight_push_refused"', 1)
    assert text.count('"weight_push_refused"') == 1 and '"level": "WARNING"' in text, text[-3000:]
    assert not refused(text), refused(text)[:20]


def cut_upload(service: str, data: bytes, hold_s: float) -> None:
    """An upload whose client goes away a third into its body, after holding the connection hold_s."""
    host, port = service.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as s:
        head = (
            f"POST /v1/weights?version={versions(service)['version'] + 1} HTTP/1.1\r\nHost: {host}\r\n"
            f"Authorization: {AUTH['Authorization']}\r\nContent-Length: {len(data)}\r\n\r\n"
        )
        s.sendall(head.encode() + data[: len(data) // 3])
        time.sleep(hold_s)


def test_a_cut_upload_logs_one_warning_line_and_no_traceback(service, tiny_model):
    """A cut that Serve's proxy passes on reaches the ingress as a disconnect mid-body. Under load the proxy may not
    have handed the request to an ingress replica yet, and then drops it itself (nothing to log): the cut is tried
    again, holding the connection longer, until the ingress has seen one. Left to chance: the proxy holding the
    request past every hold, 1, 3, 5, 7 and 9 s (only a miss costs a retry)."""
    data = (tiny_model / "model.safetensors").read_bytes()
    logs = Logs()
    for attempt in range(5):
        cut_upload(service, data, hold_s=1.0 + 2.0 * attempt)
        text = logs.wait_for('"request_cut"', 1, timeout_s=15.0)
        if '"request_cut"' in text:
            break
    assert 1 <= text.count('"request_cut"') <= attempt + 1, text[-3000:]  # one line per cut it saw
    assert not refused(text), refused(text)[:20]
    assert httpx.get(f"{service}/readyz", timeout=60).status_code == 200


def test_the_torch_engines_nccl_501_logs_one_warning_line_and_no_traceback(service):
    group = {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 3}
    logs = Logs()
    r = httpx.post(f"{service}/v1/weights/distributed/init", json=group, headers=AUTH, timeout=60)
    assert r.status_code == 501 and "NCCL" in r.json()["error"], r.text
    text = logs.wait_for('"request_not_supported"', 1)
    assert text.count('"request_not_supported"') == 1, text[-3000:]
    assert not refused(text), refused(text)[:20]
