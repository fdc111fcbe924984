"""Reads that do not fail while an engine replica dies: kill one replica's actor and read every GET endpoint while
Serve replaces it. Each answers (200), marking the missing replica where it reports replicas; /readyz alone is an
honest 503 naming it. A read that HAProxy sent to the dying replica is cut, and sent again as the farm's client does
(`resent`). At the end both replicas serve again, for the tests after this one."""

import time

import httpx
import ray

from tests.service.helpers import resent, wait_until

READS = (
    "/v1/weights/version",
    "/readyz",
    "/healthz",
    "/metrics",
    "/v1/models",
    "/v1/queue/sources",
    "/v1/samplers",
    "/v1/policy_stats",
    "/get_model_info",
    "/get_server_info",
    "/health",
    "/health_generate",
)


def engine_actors() -> list[dict]:
    return [
        a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith("SERVE_REPLICA::farm#engine")
    ]


def ready(service: str) -> dict | None:
    r = resent(lambda: httpx.get(f"{service}/readyz", timeout=60), "/readyz")
    return r.json() if r.status_code == 200 and len(r.json()["replicas"]) == 2 else None


def test_get_endpoints_answer_while_an_engine_replica_dies_and_restarts(service):
    before = {s["replica"] for s in wait_until(lambda: ready(service), "both replicas ready")["replicas"]}
    victim = engine_actors()[0]
    killed = victim["name"].rsplit("#", 1)[1]
    assert killed in before
    ray.kill(ray.get_actor(victim["name"], namespace=victim["namespace"]), no_restart=True)
    seen, marked, deadline = [], [], time.monotonic() + 180
    with httpx.Client(base_url=service, timeout=60) as http:
        while True:
            for path in READS:
                r = resent(lambda: http.get(path), path)
                seen.append((path, r.status_code))
                assert r.status_code < 500 or (path == "/readyz" and r.status_code == 503), (path, r.text)
                if path == "/v1/weights/version" and r.json()["unreachable"]:
                    marked.append(r.json()["unreachable"])
                    assert len(r.json()["replicas"]) == 1 and r.json()["version"] == min(r.json()["replicas"].values())
                if path == "/readyz" and r.status_code == 503:
                    assert r.json()["error"] == "not ready" and r.json()["detail"], r.text
                    marked.append([d["message"] for d in r.json()["detail"]])
                if path == "/healthz":
                    assert r.json()["status"] == "ok", r.text
            now = ready(service)
            if now and {s["replica"] for s in now["replicas"]} != before:
                break
            assert time.monotonic() < deadline, f"no replacement replica; last reads {seen[-len(READS) :]}"
    assert marked, "no read saw the replica missing: the kill was not observed"
    named = [m for ms in marked for m in ms if killed in m or "not running" in m]
    assert named, marked  # the dead replica by id, or as one of FARM_REPLICAS not running
    assert killed not in {s["replica"] for s in now["replicas"]}
