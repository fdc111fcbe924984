"""Churn, shortened: two tenants push new adapter versions while rollouts on them run, on two replicas. No sample
carries a digest other than that of the version its request named (the backstop's negative controls:
tests/unit/test_policy_backstop.py), and no request for a version inside the resident window is refused."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

from tests.adapters import ADMIN, push, rollout

PUSHES = 6  # per tenant; the window is 3 (FARM_ADAPTER_VERSIONS_RESIDENT's default)


def test_no_sample_from_another_policy_while_versions_churn(http, folders):
    tenants = {}
    for t in ("churn-a", "churn-b"):
        tenants[t] = {"Authorization": f"Bearer {http.post(f'/v1/tenants/{t}', headers=ADMIN).json()['token']}"}
    digests: dict[tuple[str, int], str] = {}
    newest = {t: 0 for t in tenants}
    lock = threading.Lock()

    def pusher():
        for v in range(1, PUSHES + 1):
            for i, (t, headers) in enumerate(tenants.items()):  # other bytes for each tenant and version
                answer = push(http, t, v, folders[1 + (v + 2 * i) % 5], headers=headers)
                assert answer.status_code == 200, answer.text
                with lock:
                    digests[(t, v)] = answer.json()["digest"]
                    newest[t] = v

    def sampler(t: str) -> list[tuple[str, int, int, dict]]:
        seen = []
        while True:
            with lock:
                v, done = newest[t], newest[t] == PUSHES
            if v:
                answer = rollout(http, {"name": t, "version": v}, headers=tenants[t], prompts=[{"text": "4 + 4 ="}])
                with lock:
                    seen.append((t, v, newest[t], answer.status_code, answer.json()))
            if done:
                return seen
            time.sleep(0.01)

    with ThreadPoolExecutor(3) as pool:
        runs = [pool.submit(sampler, t) for t in tenants]
        pushed = pool.submit(pusher)
        pushed.result()
        seen = [x for r in runs for x in r.result()]
    samples = 0
    for t, v, newest_after, status, body in seen:
        if status == 409:  # refused: only for a version that had left the window by then
            assert newest_after - v >= 3, (t, v, newest_after, body)
            continue
        assert status == 200, body
        for g in body["groups"]:
            for s in g["samples"]:
                samples += 1
                assert (s["policy"]["adapter"], s["policy"]["adapter_version"]) == (t, v)
                assert s["policy"]["digest"] == digests[(t, v)]
    assert samples >= 10  # the check ran on real traffic
