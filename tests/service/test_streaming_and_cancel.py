"""Streamed rollouts, cancellation by DELETE and by a dropped connection, and a retry joining the running rollout."""

import json
import socket
import uuid

import httpx

from tests.service.helpers import (
    AUTH,
    LONG_TOKENS,
    any_busy,
    greedy,
    in_thread,
    long_rollout,
    metric,
    replica_metric,
    rollout,
    wait_until,
)


def test_stream_sends_each_group_once_then_an_end_line_and_matches_the_plain_answer(service):
    body = greedy([[40 + i, 50, 60, 70] for i in range(2)], max_new_tokens=10)  # equal lengths: no padding differences
    plain = rollout(service, body).json()["groups"]
    with httpx.stream("POST", f"{service}/v1/rollouts", json={**body, "stream": True}, timeout=300) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in r.iter_lines() if line]
    events, end = lines[:-1], lines[-1]
    assert (end["done"], end["groups"], end["error"]) == (True, 2, None) and set(end) <= {
        "done",
        "groups",
        "error",
        "status",
        "filter",
    }
    assert sorted(e["index"] for e in events) == list(range(2))
    for e in events:
        assert set(e) == {"index", "group"}
        assert e["group"]["prompt_token_ids"] == [40 + e["index"], 50, 60, 70]
        assert [s["token_ids"] for s in e["group"]["samples"]] == [s["token_ids"] for s in plain[e["index"]]["samples"]]


def _generated(service: str) -> float:
    return sum(replica_metric(service, "farm_replica_generated_tokens").values())


def test_delete_cancels_a_running_rollout_and_frees_the_engines(service):
    wait_until(lambda: not any_busy(service), "replicas idle before the test")
    before, rid = _generated(service), f"cancel-{uuid.uuid4().hex}"
    body = {
        **long_rollout(n=8, max_new_tokens=4096),
        "request_id": rid,
    }  # one group: one replica call (see the saturation test)
    t, out = in_thread(lambda: rollout(service, body))
    wait_until(lambda: any_busy(service), "a replica busy with the rollout")
    r = httpx.delete(f"{service}/v1/rollouts/{rid}", headers=AUTH, timeout=30)
    assert r.status_code == 200 and r.json() == {"request_id": rid, "cancelled": True}
    t.join(120)
    assert out and out[0].status_code == 409 and "cancelled" in out[0].json()["error"]
    wait_until(lambda: not any_busy(service), "every replica idle after the cancel")
    generated = _generated(service) - before
    assert 0 < generated < 8 * 4096 / 2  # the partial work was counted; most of the 32768 tokens were never made
    assert (
        httpx.delete(f"{service}/v1/rollouts/{rid}", headers=AUTH, timeout=30).json()["cancelled"] is False
    )  # gone, not running


def test_delete_of_a_streamed_rollout_ends_the_stream_with_an_error(service):
    wait_until(lambda: not any_busy(service), "replicas idle before the test")
    rid = f"cancel-stream-{uuid.uuid4().hex}"
    body = {**long_rollout(n=2, prompts=1, max_new_tokens=4096), "request_id": rid, "stream": True}

    def read_stream():
        with httpx.stream("POST", f"{service}/v1/rollouts", json=body, timeout=300) as r:
            return r.status_code, [json.loads(line) for line in r.iter_lines() if line]

    t, out = in_thread(read_stream)
    wait_until(lambda: any_busy(service), "a replica busy with the rollout")
    assert httpx.delete(f"{service}/v1/rollouts/{rid}", headers=AUTH, timeout=30).json()["cancelled"] is True
    t.join(120)
    assert out and not isinstance(out[0], Exception), (
        f"the stream broke instead of ending with a StreamEnd line: {out!r}"
    )
    status, lines = out[0]
    end = lines[-1] if lines else {}
    assert status == 200 and end.get("done") is True and end["groups"] == 0 and "cancelled" in end["error"], lines
    assert end.get("status", 409) == 409
    wait_until(lambda: not any_busy(service), "every replica idle after the cancel")


def post_and_drop(service: str, body: dict) -> None:
    """POST a rollout on a plain socket and close it once a replica is busy with it: a real FIN at a known moment."""
    raw = json.dumps(body).encode()
    host, port = service.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(
            b"POST /v1/rollouts HTTP/1.1\r\nHost: farm\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
            % len(raw)
            + raw
        )
        wait_until(lambda: any_busy(service), "a replica busy with the rollout")
        sock.shutdown(socket.SHUT_RDWR)


def test_closing_the_connection_cancels_a_plain_rollout(service):
    wait_until(lambda: not any_busy(service), "replicas idle before the test")
    before = _generated(service)
    post_and_drop(service, long_rollout(n=8, max_new_tokens=4096))
    wait_until(lambda: not any_busy(service), "every replica idle after the client left")
    assert 0 < _generated(service) - before < 8 * 4096 / 2


def test_a_retry_after_a_dropped_connection_picks_up_the_running_rollout(service):
    """With a request_id, a caller whose connection drops (say its read timed out) has FARM_DISCONNECT_GRACE_S to send
    the request again: the retry gets the running job's result, and nothing is generated twice. Without a retry, the
    work is cancelled once the grace period is over."""
    wait_until(lambda: not any_busy(service), "replicas idle before the test")
    body = {**long_rollout(n=4), "request_id": "dropped-then-retried"}

    def replays():
        return metric(service, "farm_idempotent_replays_total")

    before, replayed = _generated(service), replays()
    post_and_drop(service, body)
    r = rollout(service, body, timeout=300)
    assert r.status_code == 200, (r.text, httpx.get(f"{service}/readyz", timeout=30).text)  # what failed, and where
    assert [len(s["token_ids"]) for s in r.json()["groups"][0]["samples"]] == [LONG_TOKENS] * 4
    assert replays() == replayed + 1  # the retry joined the first job
    assert (
        4 * LONG_TOKENS <= _generated(service) - before < 4 * LONG_TOKENS + 64
    )  # generated once (plus /readyz's one-token health checks)
    before = _generated(service)
    post_and_drop(service, {**long_rollout(n=8, max_new_tokens=4096), "request_id": "dropped-for-good"})
    wait_until(lambda: not any_busy(service), "every replica idle once the grace period was over")
    assert 0 < _generated(service) - before < 8 * 4096
