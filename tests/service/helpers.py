"""Helpers for the tests against the real service: requests, pushes, waiting, and reading replica state."""

import threading
import time
from contextlib import contextmanager

import httpx
import torch
from safetensors.torch import load_file

from tests.conftest import TOKEN
from tests.metrics_text import by_label, scrape
from tests.metrics_text import value as sample_value

AUTH = {"Authorization": f"Bearer {TOKEN}"}


LONG_TOKENS = 2048  # a few seconds of decoding for the tiny model on one core: long enough to act on while it runs


def in_thread(fn):
    """Run fn in a thread; its return value (or exception) lands in the returned list."""
    out: list = []

    def run():
        try:
            out.append(fn())
        except Exception as e:  # surfaced by the test's assertions
            out.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def resent(send, what: str, timeout_s: float = 120.0) -> httpx.Response:
    """send() again, as the farm's client does, while the front cuts it: behind HAProxy (FARM_HTTP_PROXY=haproxy) a
    request in flight to a replica that dies, or sent to it before HAProxy's health checks drop it, has its connection
    cut or gets HAProxy's 500 (the service itself never answers 500). Any other answer is returned as it is."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            r = send()
            if r.status_code != 500:
                return r
            cut = r.text
        except httpx.TransportError as e:
            cut = repr(e)
        assert time.monotonic() < deadline, f"{what}: cut until the deadline, last {cut}"
        time.sleep(0.5)


def wait_until(cond, what: str, timeout_s: float = 120.0):
    """Poll cond until it holds; fail naming `what` after a generous deadline (a hang, not a timing check)."""
    deadline = time.monotonic() + timeout_s
    while not (value := cond()):
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.05)
    return value


@contextmanager
def second_app(service: str, name: str, **settings):
    """Another app in the session's Serve instance, under /<name> (the session's port and token; one torch thread and
    no Ray CPU per engine replica, WARNING logs, unless `settings` say otherwise); yields its URL, then deletes it."""
    from ray import serve

    from rollout_farm.services.config.settings import ServiceSettings
    from rollout_farm.services.serving import server

    settings = {"engine_threads": 1, "engine_num_cpus": 0, "log_level": "WARNING", **settings}
    port = int(service.rsplit(":", 1)[1])
    server.start(ServiceSettings(api_token=TOKEN, port=port, app_name=name, **settings), route_prefix=f"/{name}")
    try:
        yield f"{service}/{name}"
    finally:
        serve.delete(name)


def replicas(service: str) -> list[dict]:
    r = httpx.get(f"{service}/readyz", timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["replicas"]


def any_busy(service: str) -> bool:
    return any(s["busy"] for s in replicas(service))


def versions(service: str) -> dict:
    return httpx.get(f"{service}/v1/weights/version", timeout=30).json()


def replica_metric(service: str, name: str) -> dict[str, float]:
    """replica id -> value of a per-replica Prometheus gauge."""
    return by_label(scrape(service), name, "replica")


def push(
    service: str, data: bytes, version: int, policy: str | None = None, headers: dict | None = None
) -> httpx.Response:
    params = {"version": version, **({"policy": policy} if policy else {})}
    return httpx.post(
        f"{service}/v1/weights", params=params, content=data, headers={**AUTH, **(headers or {})}, timeout=300
    )


def push_path(service: str, folder, version: int, **body) -> httpx.Response:
    body = {"path": str(folder), "version": version, **body}
    return httpx.post(f"{service}/v1/weights/path", json=body, headers=AUTH, timeout=300)


def rollout(service: str, body: dict, timeout: float = 300) -> httpx.Response:
    return httpx.post(f"{service}/v1/rollouts", json=body, timeout=timeout)


def greedy(prompts: list[list[int]], max_new_tokens: int = 12, n: int = 1, **extra) -> dict:
    return {
        "prompts": [{"token_ids": p} for p in prompts],
        "n": n,
        "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens, **extra},
    }


def long_rollout(n: int = 2, prompts: int = 1, max_new_tokens: int = LONG_TOKENS, **extra) -> dict:
    return greedy([[40 + i, 41, 42] for i in range(prompts)], max_new_tokens, n, ignore_eos=True, **extra)


def perturbed(tiny_model, seed: int, scale: float = 0.5) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return {k: v + scale * torch.randn_like(v) for k, v in load_file(tiny_model / "model.safetensors").items()}


def tokens(resp: httpx.Response) -> list[list[int]]:
    assert resp.status_code == 200, resp.text
    return [s["token_ids"] for g in resp.json()["groups"] for s in g["samples"]]


def metric(service: str, name: str, **labels: str) -> float:
    """The value of one Prometheus sample, e.g. metric(service, "farm_samples_total", sampler="plain")."""
    return sample_value(scrape(service), name, **labels)


def request(n=4, **params) -> dict:
    return {
        "prompts": [
            {"text": "Q: 12+3\nA:", "ground_truth": "15"},
            {"text": "Q: 40-7\nA:", "ground_truth": "33"},
            {"text": "hello"},
        ],
        "n": n,
        "sampling_params": {"max_new_tokens": 8, "seed": 1, **params},
        "reward": "gsm8k",
    }


def replace_an_engine_replica(client, timeout_s: float = 180) -> dict:
    """Kill one of the session's two engine replicas (no restart of the actor: Serve starts a replacement) and wait
    until two replicas answer again, one of them new; returns their versions by replica id."""
    import ray

    from rollout_farm.services.client import FarmError

    old = client.weights_version().replicas
    names = [
        a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith("SERVE_REPLICA::farm#engine")
    ]
    assert len(names) == 2
    ray.kill(ray.get_actor(names[0]["name"], namespace=names[0]["namespace"]), no_restart=True)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            now = client.weights_version().replicas
        except (FarmError, httpx.TransportError):  # a read HAProxy sent to the dead replica: cut, or its 500
            now = {}
        if len(now) == 2 and set(now) != set(old):
            return now
        assert time.monotonic() < deadline, f"no replacement replica: {now}"
        time.sleep(0.5)
