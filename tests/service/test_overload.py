"""Overload, answered one way: a flood of small rollouts gets 200 or the service's own 429 (Retry-After, the error
body), never Serve's plain-text 503; a full replica answers the ingress instead of raising, so every 429 is one
rejection the ingress counted (farm_overload_rejections_total)."""

import asyncio
from collections import Counter

import httpx

from rollout_farm.services.errors import QUEUES_FULL
from tests.metrics_text import by_label, scrape
from tests.service.helpers import any_busy, greedy, wait_until

FLOOD = 240  # concurrent rollouts; the fixture admits 2 replicas x (2 running + 1 waiting, its share of 2 queued)


def rejections(service: str) -> dict[str, float]:
    """farm_overload_rejections_total by kind."""
    return by_label(scrape(service), "farm_overload_rejections_total", "kind")


async def test_a_flood_of_rollouts_is_answered_200_or_our_429(service):
    assert httpx.get(f"{service}/v1/queue/sources").json() == []  # nothing else calls the replicas meanwhile
    before = rejections(service)
    body = greedy([[40, 41, 42]], max_new_tokens=2)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=120, limits=limits) as http:
        answers = await asyncio.gather(*[http.post(f"{service}/v1/rollouts", json=body) for _ in range(FLOOD)])
    codes = Counter(r.status_code for r in answers)
    assert set(codes) <= {200, 429} and codes[200] and codes[429], codes  # overloaded, and still serving
    for r in (r for r in answers if r.status_code == 429):
        assert r.headers["retry-after"] == "1" and r.json() == {"error": QUEUES_FULL, "detail": []}, r.text
    after = rejections(service)
    counted = {kind: after.get(kind, 0) - before.get(kind, 0) for kind in after}
    # which limit refuses first (a replica answering Full, or the ingress's handle queue) depends on how the two
    # ingress replicas' handles spread the flood; each refusal is counted once, and a request ends at its first
    assert sum(counted.values()) == codes[429] > 0, (counted, codes)
    wait_until(lambda: not any_busy(service), "the replicas idle after the flood")
