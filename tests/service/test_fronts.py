"""The two fronts. The session service runs the default, FARM_FRONT=fused behind HAProxy
(rollout_farm/services/serving/fused_front.py): each engine replica is its own HTTP ingress. The split front (an
ingress deployment calling the engine replicas over Ray, the default before issue 38) stays selectable and runs here
as an app of its own under /split (two engine and two ingress replicas, the same small limits) in the session's Serve
instance. What the fused front must keep of the split one, each read from the service, never from timings:
  - the same samples for the same seed and weights (a rollout, chat);
  - a rollout over both replicas, a weight push committed on both, the version floor;
  - a session's turns on its home replica, whose KV cache saves their prefill;
  - a flood of twenty times its capacity on every route family that generates, answered 200 or the service's 429
    with Retry-After (a rollout of two prompts and a new session's turns call the other replica over Serve's gRPC
    transport: over Ray actor calls, one of them under such a flood was accepted by its target and never answered);
  - the replica that holds a request killed under it: the client's retries by request_id complete it, once.
Behind HAProxy, as a process of its own, with its haproxy killed: tests/e2e/test_farm_commands.py.
"""

import asyncio
import threading
from collections import Counter

import httpx
import pytest
import ray

from rollout_farm.services import protocol as P
from rollout_farm.services.client import FarmClient
from rollout_farm.services.episodes.episodes import OVERLOAD_PATIENCE_S
from rollout_farm.services.errors import QUEUES_FULL
from tests.conftest import TOKEN
from tests.metrics_text import by_label, scrape
from tests.service.helpers import AUTH, any_busy, greedy, push, second_app, tokens, wait_until

SEEDED = {"temperature": 1.0, "max_new_tokens": 10, "seed": 7, "ignore_eos": True}
FLOOD = 160


@pytest.fixture(scope="module")
def fused(service, service_settings):
    """The session service: the default front, fused (two engine replicas, 2 running + 2 queued each)."""
    assert service_settings.front == "fused"
    wait_until(lambda: len(ready(service)) == 2, "both fused replicas ready")
    return service


@pytest.fixture(scope="module")
def split(service, tiny_model, tmp_path_factory):
    with second_app(
        service,
        "split",
        model=str(tiny_model),
        replicas=2,
        front="split",
        ingress_replicas=2,
        engine_max_ongoing_requests=2,
        engine_max_queued_requests=2,
        state_dir=str(tmp_path_factory.mktemp("split-state")),
    ) as url:
        wait_until(lambda: len(ready(url)) == 2, "both engine replicas of the split front ready")
        yield url


def ready(url: str) -> list[dict]:
    r = httpx.get(f"{url}/readyz", timeout=60)
    return r.json()["replicas"] if r.status_code == 200 else []


def prefilled(url: str) -> dict[str, float]:
    """replica id -> prompt tokens its engine has prefilled (its own counter)."""
    return by_label(scrape(url), "farm_replica_prefill_tokens", "replica")


def engine_actors(app: str) -> list[dict]:
    return [
        a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(f"SERVE_REPLICA::{app}#")
    ]


def test_the_fused_front_answers_as_the_split_one_for_the_same_seed_and_weights(split, fused, tiny_model):
    weights = (tiny_model / "model.safetensors").read_bytes()
    for url in (split, fused):  # both serve the model folder's weights, as one new version each
        version = httpx.get(f"{url}/v1/weights/version").json()["version"] + 1
        assert push(url, weights, version).status_code == 200
    body = {"prompts": [{"token_ids": [40, 41, 42]}], "n": 1, "sampling_params": SEEDED}
    theirs, own = (httpx.post(f"{url}/v1/rollouts", json=body, timeout=120) for url in (split, fused))
    assert tokens(theirs) == tokens(own)
    a, b = (r.json()["groups"][0]["samples"][0]["logprobs"] for r in (theirs, own))
    assert a == pytest.approx(b, abs=1e-5)
    chat = {"messages": [{"role": "user", "content": "Q: 1+2"}], "max_tokens": 8, "seed": 3}
    answers = [httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=120) for url in (split, fused)]
    assert all(r.status_code == 200 for r in answers), [r.text for r in answers]
    assert len({r.json()["choices"][0]["message"]["content"] for r in answers}) == 1


@pytest.mark.parametrize("front", ["fused", "split"])
def test_a_rollout_over_both_replicas_and_a_push_committed_on_both(front, request, tiny_model):
    fused = request.getfixturevalue(front)  # either front's URL
    with FarmClient(fused, TOKEN, retries=0) as client:
        version = client.weights_version().version + 1
        client.push_weights((tiny_model / "model.safetensors").read_bytes(), version)
        assert set(client.weights_version().replicas.values()) == {version}
    body = {**greedy([[40 + i, 41, 42] for i in range(4)], max_new_tokens=4, n=2), "min_weight_version": version}
    r = httpx.post(f"{fused}/v1/rollouts", json=body, timeout=120)
    assert r.status_code == 200, r.text
    groups = r.json()["groups"]
    assert [g["prompt_token_ids"] for g in groups] == [[40 + i, 41, 42] for i in range(4)]
    assert {s["weight_version"] for g in groups for s in g["samples"]} == {version}
    # A rollout's first chunk runs on the replica that took it, the others where Serve's handle sends them: itself
    # again or the other replica, its choice (a tie, both idle: about even). Left to chance, so sent up to 30 times
    # until both replicas have run a chunk of one rollout (all 30 on one replica: p ~ 1e-9).
    for _ in range(30):
        before = prefilled(fused)
        r = httpx.post(f"{fused}/v1/rollouts", json=greedy([[50 + i, 41] for i in range(8)], 2), timeout=120)
        assert r.status_code == 200 and len(r.json()["groups"]) == 8, r.text
        if all(v > before.get(rep, 0) for rep, v in prefilled(fused).items()):
            break  # its chunks ran on both replicas
    else:
        raise AssertionError("30 rollouts of 8 prompts, each run on one replica only")


@pytest.mark.parametrize("front", ["fused", "split"])
def test_a_session_stays_on_its_home_replica_and_reuses_its_cache(front, request):
    fused = request.getfixturevalue(front)  # either front's URL
    sid = httpx.post(f"{fused}/v1/sessions", json={"sampling_params": SEEDED}, timeout=30).json()["session_id"]
    homes = set()
    for k, ids in enumerate([[40, 41, 42, 43, 44], [50, 51], [60, 61, 62]]):
        before = prefilled(fused)
        r = httpx.post(f"{fused}/v1/sessions/{sid}/generate", json={"append_token_ids": ids}, timeout=120)
        assert r.status_code == 200, r.text
        moved = {rep: v - before.get(rep, 0) for rep, v in prefilled(fused).items() if v != before.get(rep, 0)}
        (home,) = moved
        homes.add(home)
        if k:
            assert moved[home] == len(ids) + 1  # the new ids and the last sampled token: the rest was cached
    assert len(homes) == 1, homes


# Each route family that generates, as (path, body). {sid} is one of FLOOD sessions opened before the flood.
FAMILIES = {
    "rollouts": ("/v1/rollouts", greedy([[40, 41, 42]], max_new_tokens=2)),
    "rollouts over both replicas": ("/v1/rollouts", greedy([[40, 41, 42], [43, 44]], max_new_tokens=2)),
    "session turns": (
        "/v1/sessions/{sid}/generate",
        {"append_token_ids": [40, 41], "sampling_params": {"max_new_tokens": 2}},
    ),
    "openai chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Q: 1+2"}], "max_tokens": 2}),
    "openai completions": ("/v1/completions", {"prompt": "Q: 1+2", "max_tokens": 2}),
    "sglang generate": ("/generate", {"input_ids": [40, 41], "sampling_params": {"max_new_tokens": 2}}),
    "episodes": (
        "/v1/episodes",
        {
            "env": {"name": "calculator"},
            "prompts": [{"text": "Q: 2+2\nA:"}],
            "max_turns": 1,
            "sampling_params": {"max_new_tokens": 2},
        },
    ),
}


FLOODED = [("fused", family) for family in FAMILIES] + [
    ("split", "rollouts over both replicas"),
    ("split", "session turns"),
]


@pytest.mark.parametrize(("front", "family"), FLOODED)
async def test_a_flood_of_ten_times_capacity_is_answered_200_or_our_429_on_every_route_family(front, family, request):
    """Capacity: 2 replicas x (2 running + 2 queued) = 8 requests; FLOOD is 20 times it. An episode waits out the
    engines' 429s for up to OVERLOAD_PATIENCE_S (its group's episodes run at once), so a flood of episodes, ten times
    the capacity, is answered 200 later, not refused: only 200 and 429 still. The split front: the families that call
    an engine replica from another process (every family does there); tests/service/test_overload.py floods more."""
    fused = request.getfixturevalue(front)  # either front's URL
    path, body = FAMILIES[family]
    waits = family == "episodes"
    count = FLOOD // 2 if waits else FLOOD
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=OVERLOAD_PATIENCE_S if waits else 120, limits=limits) as http:
        sids = [""] * count
        if "{sid}" in path:
            opened = await asyncio.gather(*[http.post(f"{fused}/v1/sessions", json={}) for _ in range(count)])
            sids = [r.json()["session_id"] for r in opened]
        answers = await asyncio.gather(*[http.post(fused + path.format(sid=sid), json=body) for sid in sids])
    codes = Counter(r.status_code for r in answers)
    # A rollout over both replicas needs a slot on each at once: at 20x capacity every try may meet one full (on the
    # fused front its own replica's slot is taken first, in process), so all of them may be 429s. Still answered.
    some = codes[200] or family == "rollouts over both replicas"
    assert set(codes) <= {200, 429} and some and (codes[429] or waits), (family, codes, answers[-1].text[:300])
    for r in (r for r in answers if r.status_code == 429):
        assert r.headers["retry-after"] == "1" and QUEUES_FULL in r.text, r.text
    wait_until(lambda: not any_busy(fused), "the replicas idle after the flood")


def test_killing_the_replica_that_holds_a_request_the_retry_by_request_id_completes_it_once(fused):
    """The client sends a long rollout with a request_id; the replica that took it (its prefill counter moved) is
    killed. The client's retries (a 5xx, or the connection cut) reach the other replica, whose answer is the one
    rollout of that id: its groups whole, and a replay of the id after it gives the same samples."""
    body = greedy([[70, 71, 72]], max_new_tokens=400, n=2, ignore_eos=True)
    before = prefilled(fused)
    result: dict = {}

    def send():
        with FarmClient(fused, TOKEN, retries=8) as client:
            result["answer"] = client.rollouts(P.RolloutRequest(**body, request_id="fused-kill-1"))

    sender = threading.Thread(target=send)
    sender.start()
    taker = wait_until(
        lambda: [r for r, v in prefilled(fused).items() if v > before.get(r, 0)], "a replica takes the rollout"
    )[0]
    (victim,) = [a for a in engine_actors("farm") if a["name"].endswith(f"#{taker}")]
    ray.kill(ray.get_actor(victim["name"], namespace=victim["namespace"]), no_restart=True)
    sender.join(timeout=300)
    assert not sender.is_alive() and "answer" in result
    groups = result["answer"].groups
    assert len(groups) == 1 and len(groups[0].samples) == 2
    assert all(len(s.token_ids) == 400 for s in groups[0].samples)
    again = httpx.post(
        f"{fused}/v1/rollouts", json={**body, "request_id": "fused-kill-1"}, headers=AUTH, timeout=120
    ).json()
    assert [s["token_ids"] for s in again["groups"][0]["samples"]] == [s.token_ids for s in groups[0].samples]
    wait_until(lambda: len(ready(fused)) == 2, "a replacement fused replica", 180)
