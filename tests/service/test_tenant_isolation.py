"""Tenant isolation over every route of the app (docs/tenants.md): tenant B's token on tenant A's adapters, sessions
(also those of A's episodes), queue sources, rollouts by request_id, and Tinker sessions, samplers and futures gets
401, 403 or 404 (or, where the route answers for B's own namespace, B's own empty answer), and never A's data.

Every route is classified in ROUTES: the kinds of tenant-owned resource it reads or changes (each kind has its probe
below, which must exercise exactly the routes of its kind), ADMIN_ONLY (a tenant's token is a 401), or OPEN (shared:
nothing of a tenant's). The first test fails on a route of the app that is not classified, or on a stale entry, so a
new route cannot be skipped silently. The routes come from /openapi.json and, for those left out of it (Tinker's,
FastAPI's docs), from the app's own route table."""

from __future__ import annotations

import json
import time
import uuid

import httpx
import pytest

from tests.adapters import ADMIN, push
from tests.service.helpers import any_busy, in_thread, long_rollout, wait_until

OPEN, ADMIN_ONLY = "open", "admin only"
ADAPTER, SESSION, EPISODE, QUEUE, ROLLOUT_ID, TINKER = "adapter", "session", "episode", "queue", "request_id", "tinker"

ROUTES: dict[tuple[str, str], tuple[str, ...]] = {
    ("GET", "/v1/samplers"): (OPEN,),
    ("GET", "/v1/policy_stats"): (OPEN,),  # the trainer's policy stats: the farm's, no tenant's
    ("POST", "/v1/policy_stats"): (ADMIN_ONLY,),
    ("GET", "/v1/weights/version"): (OPEN,),
    ("GET", "/v1/queue/sources"): (QUEUE,),
    ("POST", "/v1/queue/sources"): (QUEUE, ADAPTER),
    ("DELETE", "/v1/queue/sources/{name}"): (QUEUE,),
    ("POST", "/v1/queue/sources/{name}/prompts"): (QUEUE,),
    ("POST", "/v1/queue/pull"): (QUEUE,),
    ("POST", "/v1/queue/ack"): (QUEUE,),
    ("GET", "/healthz"): (OPEN,),
    ("GET", "/readyz"): (OPEN,),
    ("GET", "/metrics"): (OPEN,),  # counts per tenant id (the admin names them), never a tenant's resource
    ("GET", "/model_info"): (OPEN,),
    ("GET", "/get_model_info"): (OPEN,),
    ("GET", "/server_info"): (OPEN,),
    ("GET", "/get_server_info"): (OPEN,),
    ("GET", "/health_generate"): (OPEN,),
    ("GET", "/health"): (OPEN,),
    ("GET", "/v1/adapters"): (ADAPTER,),
    ("GET", "/v1/adapters/{name}"): (ADAPTER,),
    ("POST", "/v1/adapters/{name}"): (ADAPTER,),
    ("POST", "/v1/adapters/{name}/path"): (ADAPTER,),
    ("DELETE", "/v1/adapters/{name}"): (ADAPTER,),
    ("GET", "/v1/tenants"): (ADMIN_ONLY,),
    ("POST", "/v1/tenants/{tenant}"): (ADMIN_ONLY,),
    ("DELETE", "/v1/tenants/{tenant}"): (ADMIN_ONLY,),
    ("PUT", "/v1/tenants/{tenant}/quota"): (ADMIN_ONLY,),
    ("POST", "/v1/rollouts"): (ROLLOUT_ID, ADAPTER),
    ("DELETE", "/v1/rollouts/{request_id}"): (ROLLOUT_ID,),
    ("GET", "/v1/models"): (ADAPTER,),
    ("POST", "/v1/completions"): (ADAPTER,),
    ("POST", "/v1/chat/completions"): (ADAPTER,),
    ("POST", "/generate"): (ADAPTER,),
    ("PUT", "/generate"): (ADAPTER,),
    ("POST", "/inference/v1/generate"): (ADAPTER,),
    ("GET", "/v1/sessions"): (ADMIN_ONLY,),
    ("DELETE", "/v1/sessions/{session_id}"): (ADMIN_ONLY,),
    ("POST", "/v1/sessions"): (ADAPTER,),
    ("GET", "/v1/sessions/{session_id}"): (SESSION, EPISODE),
    ("POST", "/v1/sessions/{session_id}/generate"): (SESSION,),
    ("POST", "/v1/sessions/{session_id}/chat/completions"): (SESSION,),
    ("POST", "/v1/sessions/{session_id}/anthropic/v1/messages"): (SESSION,),
    ("POST", "/v1/sessions/{session_id}/anthropic/v1/messages/count_tokens"): (SESSION,),
    ("POST", "/v1/sessions/{session_id}/v1/responses"): (SESSION,),
    ("POST", "/v1/sessions/{session_id}/responses"): (SESSION,),
    ("POST", "/v1/sessions/{session_id}/inference/v1/generate"): (SESSION,),
    ("POST", "/v1/sessions/{session_id}/reward"): (SESSION,),
    ("POST", "/v1/sessions/{session_id}/close"): (SESSION,),
    ("GET", "/v1/sessions/{session_id}/trajectory"): (SESSION, EPISODE),
    ("POST", "/v1/episodes"): (EPISODE, ADAPTER),
    ("GET", "/v1/environments"): (OPEN,),
    ("POST", "/v1/weights"): (ADMIN_ONLY,),
    ("POST", "/v1/weights/path"): (ADMIN_ONLY,),
    ("POST", "/v1/weights/distributed/init"): (ADMIN_ONLY,),
    ("POST", "/v1/weights/distributed"): (ADMIN_ONLY,),
    ("POST", "/v1/pause"): (ADMIN_ONLY,),
    ("POST", "/v1/resume"): (ADMIN_ONLY,),
    ("POST", "/v1/abort"): (ADMIN_ONLY,),
    ("POST", "/update_weights_from_disk"): (ADMIN_ONLY,),
    ("POST", "/init_weights_update_group"): (ADMIN_ONLY,),
    ("POST", "/update_weights_from_distributed"): (ADMIN_ONLY,),
    ("POST", "/pause_generation"): (ADMIN_ONLY,),
    ("POST", "/continue_generation"): (ADMIN_ONLY,),
    ("GET", "/flush_cache"): (ADMIN_ONLY,),
    ("POST", "/flush_cache"): (ADMIN_ONLY,),
    ("POST", "/abort_request"): (ADMIN_ONLY,),
    # not in /openapi.json: Tinker's routes (X-API-Key; a key is the admin's or a tenant's), FastAPI's docs
    ("POST", "/api/v1/client/config"): (OPEN,),
    ("POST", "/api/v1/client/dynamic_config"): (OPEN,),
    ("POST", "/api/v1/create_session"): (OPEN,),  # makes the caller's own session
    ("POST", "/api/v1/session_heartbeat"): (TINKER,),
    ("POST", "/api/v1/sessions/{session_id}/finish"): (TINKER,),
    ("POST", "/api/v1/create_sampling_session"): (TINKER,),
    ("GET", "/api/v1/samplers/{sampler_id}"): (TINKER,),
    ("POST", "/api/v1/asample"): (TINKER,),
    ("POST", "/api/v1/retrieve_future"): (TINKER,),
    ("POST", "/api/v1/cancel_future"): (OPEN,),  # changes nothing
    ("GET", "/api/v1/get_server_capabilities"): (OPEN,),
    ("POST", "/api/v1/telemetry"): (OPEN,),
    ("GET", "/api/v1/healthz"): (OPEN,),
    **{(m, "/api/v1/{path}"): (OPEN,) for m in ("GET", "POST", "PUT", "PATCH", "DELETE")},  # a 404 saying so
    ("GET", "/openapi.json"): (OPEN,),
    ("GET", "/docs"): (OPEN,),
    ("GET", "/docs/oauth2-redirect"): (OPEN,),
    ("GET", "/redoc"): (OPEN,),
}
REFUSED = (401, 403, 404)


def base(http: httpx.Client) -> str:
    return str(http.base_url).rstrip("/")


def of_kind(kind: str) -> set[tuple[str, str]]:
    return {route for route, kinds in ROUTES.items() if kind in kinds}


def refused(answer: httpx.Response, *secrets: str, codes=REFUSED) -> None:
    """The answer refuses (401, 403 or 404), and holds none of A's secrets."""
    assert answer.status_code in codes, (answer.request.method, answer.request.url, answer.status_code, answer.text)
    for secret in secrets:
        assert secret not in answer.text, (answer.request.url, secret)


class Probe:
    """The calls of one probe, by route: the probe must cover every route of its kind."""

    def __init__(self, kind: str):
        self.kind, self.done = kind, set()

    def __call__(self, method: str, path: str) -> tuple[str, str]:
        self.done.add((method, path))
        return method, path

    def covered(self) -> None:
        assert self.done == of_kind(self.kind), f"{self.kind}: not probed {of_kind(self.kind) - self.done}"


@pytest.fixture
def tenants(http) -> tuple[dict, dict]:
    """Tenants iso-a and iso-b: their bearer headers (the http fixture revokes them afterwards)."""
    made = [http.post(f"/v1/tenants/{t}", headers=ADMIN) for t in ("iso-a", "iso-b")]
    assert all(m.status_code == 200 for m in made), [m.text for m in made]
    return tuple({"Authorization": f"Bearer {m.json()['token']}"} for m in made)


def app_routes() -> set[tuple[str, str]]:
    """Every route of the app as it is built (also those left out of /openapi.json), its path as OpenAPI writes it."""
    from rollout_farm.services.api import create_api

    def walk(routes, prefix: str = ""):
        for route in routes:
            if hasattr(route, "original_router"):  # FastAPI >= 0.165 keeps an included router as one entry
                yield from walk(route.original_router.routes, prefix + route.include_context.prefix)
            elif hasattr(route, "path"):
                path = (prefix + route.path).replace("{path:path}", "{path}")
                yield from ((m, path) for m in getattr(route, "methods", None) or () if m != "HEAD")

    return set(walk(create_api().routes))


def test_every_route_is_classified(http):
    published = {(m.upper(), p) for p, ops in http.get("/openapi.json").json()["paths"].items() for m in ops}
    assert published <= app_routes()
    routes = published | app_routes()
    assert routes - set(ROUTES) == set(), "classify these routes in ROUTES (tenant-owned with a probe, or not)"
    assert set(ROUTES) - routes == set(), "these routes are gone: take them out of ROUTES"


def test_admin_only_routes_refuse_a_tenant_token(http, tenants):
    a, _ = tenants
    for method, path in sorted(of_kind(ADMIN_ONLY)):
        url = path.replace("{tenant}", "iso-b").replace("{session_id}", uuid.uuid4().hex)
        answer = http.request(method, url, json={}, headers=a)
        assert answer.status_code == 401, (method, path, answer.status_code, answer.text)
    assert http.get("/v1/tenants", headers=ADMIN).status_code == 200  # negative control: the admin's token


def test_another_tenants_adapter_is_unknown_on_every_route(http, tenants, folders):
    a, b = tenants
    probe = Probe(ADAPTER)
    assert push(http, "iso-a-lora", 1, folders[1], headers=a).status_code == 200
    info = http.get("/v1/adapters/iso-a-lora", headers=a).json()
    digest = info["versions"][0]["digest"]
    ref, short = {"name": "iso-a-lora", "version": 1}, {"temperature": 0, "max_new_tokens": 2}

    def as_(who, method_path, **kw):
        method, path = probe(*method_path)
        return http.request(method, path.replace("{name}", "iso-a-lora"), headers=who, **kw)

    names = [x["name"] for x in as_(b, ("GET", "/v1/adapters")).json()["adapters"]]
    assert "iso-a-lora" not in names and "iso-a-lora" in [
        x["name"] for x in http.get("/v1/adapters", headers=a).json()["adapters"]
    ]
    refused(as_(b, ("GET", "/v1/adapters/{name}")), digest)
    refused(as_(b, ("POST", "/v1/adapters/{name}"), params={"version": 2}, content=b"x" * 16), digest)
    refused(as_(b, ("POST", "/v1/adapters/{name}/path"), json={"path": str(folders[2]), "version": 2}), digest)
    refused(as_(b, ("DELETE", "/v1/adapters/{name}")), digest)
    models = [m["id"] for m in as_(b, ("GET", "/v1/models")).json()["data"]]
    assert "iso-a-lora@v1" not in models and "iso-a-lora@v1" in [
        m["id"] for m in http.get("/v1/models", headers=a).json()["data"]
    ]
    body = {"prompts": [{"text": "1 + 2 ="}], "n": 1, "sampling_params": short, "adapter": ref}
    refused(as_(b, ("POST", "/v1/rollouts"), json=body), digest)
    refused(
        as_(b, ("POST", "/v1/completions"), json={"model": "iso-a-lora@v1", "prompt": "1", "max_tokens": 2}), digest
    )
    chat = {"model": "iso-a-lora@v1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    refused(as_(b, ("POST", "/v1/chat/completions"), json=chat), digest)
    base = http.post("/v1/chat/completions", json={**chat, "model": "iso-a-lora"}, headers=b).json()
    assert "iso-a-lora" not in base["model"]  # a name B may not use is any other name: the base model, as documented
    generate = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}, "lora_path": "iso-a-lora@v1"}
    refused(as_(b, ("POST", "/generate"), json=generate), digest)
    refused(as_(b, ("PUT", "/generate"), json=generate), digest)
    tokens_in = {"model": "iso-a-lora@v1", "token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 2}}
    refused(as_(b, ("POST", "/inference/v1/generate"), json=tokens_in), digest)
    refused(as_(b, ("POST", "/v1/sessions"), json={"sampling_params": short, "adapter": ref}), digest)
    episode = {"env": {"name": "calculator"}, "prompts": [{"text": "1"}], "n": 1, "sampling_params": short}
    refused(as_(b, ("POST", "/v1/episodes"), json={**episode, "adapter": ref}), digest)
    source = {"name": "iso-b-lora-src", "prompts": [{"text": "1"}], "n": 1, "adapter": ref}
    refused(as_(b, ("POST", "/v1/queue/sources"), json=source), digest)
    assert "iso-b-lora-src" not in http.get("/v1/queue/sources", headers=ADMIN).text  # nothing was made
    probe.covered()
    # positive control: A's own token reaches all of it, and the adapter is as A left it
    assert http.get("/v1/adapters/iso-a-lora", headers=a).json()["versions"] == info["versions"]
    assert http.post("/v1/rollouts", json=body, headers=a).status_code == 200


def test_another_tenants_session_is_unknown_on_every_route(http, tenants):
    a, b = tenants
    probe = Probe(SESSION)
    greedy = {"temperature": 0, "max_new_tokens": 3, "ignore_eos": True}
    sid = http.post("/v1/sessions", json={"sampling_params": greedy}, headers=a).json()["session_id"]
    turn = http.post(f"/v1/sessions/{sid}/generate", json={"append_token_ids": [40, 41, 42]}, headers=a)
    assert turn.status_code == 200, turn.text
    secret = json.dumps(turn.json()["token_ids"])[1:-1]  # the ids A's turn sampled, as they would appear in JSON

    def as_(who, method, path, body=None):
        probe(method, path)
        return http.request(method, path.replace("{session_id}", sid), json=body, headers=who)

    for who in (b, {}):  # another tenant, and no token at all
        refused(as_(who, "GET", "/v1/sessions/{session_id}"), secret)
        refused(as_(who, "POST", "/v1/sessions/{session_id}/generate", {"append_token_ids": [1]}), secret)
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        refused(as_(who, "POST", "/v1/sessions/{session_id}/chat/completions", chat), secret)
        said = {"model": "m", "max_tokens": 2, "messages": chat["messages"]}
        refused(as_(who, "POST", "/v1/sessions/{session_id}/anthropic/v1/messages", said), secret)
        counted = {"model": "m", "messages": chat["messages"]}
        refused(as_(who, "POST", "/v1/sessions/{session_id}/anthropic/v1/messages/count_tokens", counted), secret)
        for door in ("/v1/sessions/{session_id}/v1/responses", "/v1/sessions/{session_id}/responses"):
            refused(as_(who, "POST", door, {"input": "hi", "max_output_tokens": 2}), secret)
        tokens = {"token_ids": [40, 41, 42], "sampling_params": {"max_tokens": 2}}
        refused(as_(who, "POST", "/v1/sessions/{session_id}/inference/v1/generate", tokens), secret)
        refused(as_(who, "POST", "/v1/sessions/{session_id}/reward", {"reward": 1.0}), secret)
        refused(as_(who, "POST", "/v1/sessions/{session_id}/close"), secret)
        refused(as_(who, "GET", "/v1/sessions/{session_id}/trajectory"), secret)
    probe.covered()
    # nothing changed: A's session is open, unrewarded, with its one turn
    info = http.get(f"/v1/sessions/{sid}", headers=a).json()
    assert info["closed"] is False and info["turns"] == 1
    (segment,) = http.get(f"/v1/sessions/{sid}/trajectory", headers=a).json()["segments"]
    assert segment["token_ids"] == [40, 41, 42, *turn.json()["token_ids"]]


def test_an_anthropic_sdks_api_key_is_its_tenants_token(service, http, tenants):
    """Anthropic's SDK (and Claude Code) sends its key as `x-api-key`, not as a bearer token: the farm reads it as the
    token, so `api_key=<tenant token>` reaches the tenant's own session and another tenant's key does not."""
    from anthropic import Anthropic, NotFoundError

    a, b = tenants
    sid = http.post("/v1/sessions", json={}, headers=a).json()["session_id"]

    def client(who: dict) -> Anthropic:
        key = who["Authorization"].removeprefix("Bearer ")
        return Anthropic(base_url=f"{service}/v1/sessions/{sid}/anthropic", api_key=key, max_retries=0)

    ask = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert client(a).messages.count_tokens(**ask).input_tokens > 0
    with pytest.raises(NotFoundError):
        client(b).messages.count_tokens(**ask)


def test_the_sessions_of_a_tenants_episodes_are_its_own(http, tenants):
    a, b = tenants
    probe = Probe(EPISODE)
    probe("POST", "/v1/episodes")
    body = {
        "env": {"name": "calculator"},
        "prompts": [{"text": "Q: 1+1\nA:", "ground_truth": "2"}],
        "n": 1,
        "max_turns": 1,
        "sampling_params": {"temperature": 0, "max_new_tokens": 4},
    }
    out = http.post("/v1/episodes", json=body, headers=a)
    assert out.status_code == 200, out.text
    with http.stream("POST", "/v1/episodes", json={**body, "stream": True}, headers=a) as r:
        lines = [json.loads(line) for line in r.iter_lines() if line]
    sids = [out.json()["groups"][0]["episodes"][0]["session_id"], lines[0]["episodes"][0]["session_id"]]
    for sid in sids:
        for path in ("/v1/sessions/{session_id}", "/v1/sessions/{session_id}/trajectory"):
            probe("GET", path)
            for who in (b, {}):
                refused(http.get(path.replace("{session_id}", sid), headers=who))
            assert http.get(path.replace("{session_id}", sid), headers=a).status_code == 200
    probe.covered()


def test_another_tenants_queue_source_is_unknown(http, tenants):
    a, b = tenants
    probe = Probe(QUEUE)
    secret = f"iso-secret-{uuid.uuid4().hex[:8]}"
    spec = {"prompts": [{"text": f"{secret} 1 + 2 ="}], "n": 1, "target_groups": 1}
    spec["sampling_params"] = {"max_new_tokens": 3, "temperature": 1.0}
    probe("POST", "/v1/queue/sources")
    made = http.post("/v1/queue/sources", json={"name": "iso-a-src", **spec}, headers=a)
    assert made.status_code == 200, made.text
    # the same name is taken: B learns nothing of A's source
    refused(http.post("/v1/queue/sources", json={"name": "iso-a-src", **spec}, headers=b), secret, codes=(409,))
    assert http.post("/v1/queue/sources", json={"name": "iso-b-src", **spec}, headers=b).status_code == 200

    def listed(who) -> list[str]:
        probe("GET", "/v1/queue/sources")
        return sorted(s["name"] for s in http.get("/v1/queue/sources", headers=who).json())

    assert (listed(a), listed(b)) == (["iso-a-src"], ["iso-b-src"])
    assert {"iso-a-src", "iso-b-src"} <= set(listed(ADMIN)) and not {"iso-a-src", "iso-b-src"} & set(listed({}))
    wait_until(lambda: next(s for s in http.get("/v1/queue/sources", headers=a).json())["ready"] >= 1, "A's group")
    probe("POST", "/v1/queue/pull")
    refused(http.post("/v1/queue/pull", json={"source": "iso-a-src"}, headers=b), secret)
    mine = http.post("/v1/queue/pull", json={"source": "iso-b-src", "wait_s": 60}, headers=b).json()["items"]
    assert mine and all(i["item_id"].startswith("iso-b-src:") for i in mine)  # never one of A's groups
    (item,) = http.post("/v1/queue/pull", json={"source": "iso-a-src", "wait_s": 60}, headers=a).json()["items"]
    probe("POST", "/v1/queue/ack")
    acked = http.post("/v1/queue/ack", json={"item_ids": [item["item_id"]]}, headers=b).json()
    assert acked == {"acked": [], "already_acked": [], "unknown": [item["item_id"]]}
    probe("POST", "/v1/queue/sources/{name}/prompts")
    refused(http.post("/v1/queue/sources/iso-a-src/prompts", json={"prompts": [{"text": "x"}]}, headers=b), secret)
    probe("DELETE", "/v1/queue/sources/{name}")
    refused(http.delete("/v1/queue/sources/iso-a-src", headers=b), secret)
    probe.covered()
    # A's source is as it was: its item is still A's to ack, and no prompt was added
    assert http.post("/v1/queue/ack", json={"item_ids": [item["item_id"]]}, headers=a).json()["acked"] == [
        item["item_id"]
    ]
    state = next(s for s in http.get("/v1/queue/sources", headers=a).json())
    assert state["acked"] == 1 and state["pending_prompts"] == 0
    for name, who in (("iso-a-src", a), ("iso-b-src", b)):
        assert http.delete(f"/v1/queue/sources/{name}", headers=who).status_code == 200


def test_a_tenants_request_ids_are_its_own(http, tenants):
    a, b = tenants
    probe = Probe(ROLLOUT_ID)
    probe("POST", "/v1/rollouts")
    rid = f"iso-{uuid.uuid4().hex}"
    body = {"prompts": [{"token_ids": [40, 41, 42]}], "n": 1, "request_id": rid}
    body["sampling_params"] = {"temperature": 0, "max_new_tokens": 3, "ignore_eos": True}
    other = {**body, "sampling_params": {**body["sampling_params"], "max_new_tokens": 4}}
    assert http.post("/v1/rollouts", json=body, headers=a).status_code == 200
    assert http.post("/v1/rollouts", json=other, headers=a).status_code == 409  # A's id, another body: A's record
    for who in (b, {}, ADMIN):  # the same id is another request for anyone else: no 409, no replay of A's
        answer = http.post("/v1/rollouts", json=other, headers=who)
        assert answer.status_code == 200 and len(answer.json()["groups"][0]["samples"][0]["token_ids"]) == 4
    # SGLang's rid keys the same records: A's own, as a request_id is
    generate = {"input_ids": [40, 41, 42], "rid": f"iso-rid-{uuid.uuid4().hex}"}
    generate["sampling_params"] = {"temperature": 0, "max_new_tokens": 3, "ignore_eos": True}
    longer = {**generate, "sampling_params": {**generate["sampling_params"], "max_new_tokens": 4}}
    assert http.post("/generate", json=generate, headers=a).status_code == 200
    assert http.post("/generate", json=longer, headers=a).status_code == 409
    for who in (b, {}):
        answer = http.post("/generate", json=longer, headers=who)
        assert answer.status_code == 200 and len(answer.json()["output_ids"]) == 4, answer.text
    # DELETE: B's token cannot cancel A's running rollout, nor cut it short and read what it made
    probe("DELETE", "/v1/rollouts/{request_id}")
    wait_until(lambda: not any_busy(base(http)), "replicas idle before the test")
    long_id = f"iso-long-{uuid.uuid4().hex}"
    t, out = in_thread(lambda: http.post("/v1/rollouts", json={**long_rollout(n=1), "request_id": long_id}, headers=a))
    wait_until(lambda: any_busy(base(http)), "a replica busy with A's rollout")
    for params in ({"partial": "true"}, {}):
        answer = http.delete(f"/v1/rollouts/{long_id}", params=params, headers=b)
        assert answer.status_code == 200 and answer.json() == {"request_id": long_id, "cancelled": False}
    assert any_busy(base(http))  # A's still runs
    refused(http.delete(f"/v1/rollouts/{long_id}"), codes=(401,))
    assert http.delete(f"/v1/rollouts/{long_id}", headers=a).json()["cancelled"] is True
    t.join(120)
    assert out and out[0].status_code == 409 and "cancelled" in out[0].json()["error"]
    probe.covered()


def test_the_admin_cancels_a_tenants_rollout_by_its_id(http, tenants):
    a, _ = tenants
    wait_until(lambda: not any_busy(base(http)), "replicas idle before the test")
    long_id = f"iso-admin-{uuid.uuid4().hex}"
    t, out = in_thread(lambda: http.post("/v1/rollouts", json={**long_rollout(n=1), "request_id": long_id}, headers=a))
    wait_until(lambda: any_busy(base(http)), "a replica busy with A's rollout")
    assert http.delete(f"/v1/rollouts/{long_id}", headers=ADMIN).json()["cancelled"] is True
    t.join(120)
    assert out and out[0].status_code == 409


def test_another_tenants_tinker_session_sampler_and_future_are_unknown(http, tenants):
    a, b = ({"X-API-Key": h["Authorization"].removeprefix("Bearer ")} for h in tenants)
    probe = Probe(TINKER)
    session = http.post("/api/v1/create_session", json={}, headers=a).json()["session_id"]
    probe("POST", "/api/v1/session_heartbeat")
    refused(http.post("/api/v1/session_heartbeat", json={"session_id": session}, headers=b))
    probe("POST", "/api/v1/create_sampling_session")
    made = {"session_id": session, "sampling_session_seq_id": 0, "base_model": "tiny-llama"}
    refused(http.post("/api/v1/create_sampling_session", json=made, headers=b))
    sampler = http.post("/api/v1/create_sampling_session", json=made, headers=a).json()["sampling_session_id"]
    probe("GET", "/api/v1/samplers/{sampler_id}")
    refused(http.get(f"/api/v1/samplers/{sampler}", headers=b))
    sample = {
        "sampling_session_id": sampler,
        "seq_id": 0,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [40, 41, 42]}]},
        "sampling_params": {"max_tokens": 2},
    }
    probe("POST", "/api/v1/asample")
    refused(http.post("/api/v1/asample", json=sample, headers=b))
    future = http.post("/api/v1/asample", json=sample, headers=a).json()["request_id"]
    probe("POST", "/api/v1/retrieve_future")
    refused(http.post("/api/v1/retrieve_future", json={"request_id": future}, headers=b))
    probe("POST", "/api/v1/sessions/{session_id}/finish")
    assert http.post(f"/api/v1/sessions/{session}/finish", headers=b).json() == {}  # another's: nothing happens
    assert http.post("/api/v1/session_heartbeat", json={"session_id": session}, headers=a).status_code == 200
    for _ in range(10):
        mine = http.post("/api/v1/retrieve_future", json={"request_id": future}, headers=a)
        if mine.headers["content-type"] == "application/x-protobuf":
            break
        time.sleep(0.5)
    assert mine.status_code == 200 and mine.headers["content-type"] == "application/x-protobuf"
    probe.covered()
