"""The committed weights across clusters that share one Redis (a RayService upgrade, a restart of Ray): the store
(rollout_farm/services/weights/store.py) with a real redis-server and Ray's object store, and a second app that starts
on a record it cannot load."""

import json

import httpx
import numpy as np
import pytest
import ray
import redis

from rollout_farm.services.state.embedded_redis import EmbeddedRedis
from rollout_farm.services.weights.store import Store, weights_key
from tests.service.helpers import AUTH, greedy, push_path, replicas, second_app, wait_until

PREFIX = "farm:store-test"


@pytest.fixture
def redis_url(tmp_path):
    embedded = EmbeddedRedis(tmp_path / "redis")
    yield embedded.start()
    embedded.stop()


def bucket(data: bytes):
    return ray.put(np.frombuffer(data, np.uint8))


def contents(refs: list) -> list[bytes]:
    return [np.asarray(ray.get(r)).tobytes() for r in refs]


def record(url: str, prefix: str = PREFIX) -> dict:
    return redis.Redis.from_url(url, decode_responses=True).hgetall(weights_key(prefix))


def test_uploads_kept_under_uploads_dir_are_loaded_by_the_next_cluster(service, redis_url, tiny_model, tmp_path):
    data = (tiny_model / "model.safetensors").read_bytes()
    uploads = tmp_path / "uploads"
    old = Store(redis_url, PREFIX, str(uploads))
    old.commit(3, ("bytes", [bucket(data), bucket(data[:64])]))
    new = Store(redis_url, PREFIX)  # the next cluster: it reads what the record lists
    version, source, lost = new.current()
    assert (version, source[0], lost) == (3, "bytes", None) and contents(source[1]) == [data, data[:64]]

    old.commit(4, ("delta", {"base": 3, "refs": [bucket(b"delta-4")], "bytes": 7}))
    version, source, _ = Store(redis_url, PREFIX).current()
    assert version == 4 and source[0] == "chain" and [v for v, _ in source[1]] == [3, 4]
    (_, full), (_, (kind, delta)) = source[1]
    assert full[0] == "bytes" and contents(full[1]) == [data, data[:64]]
    assert kind == "delta" and contents(delta["refs"]) == [b"delta-4"] and (delta["base"], delta["bytes"]) == (3, 7)
    assert len(list(uploads.iterdir())) == 2

    old.commit(5, ("bytes", [bucket(data)]))  # a full push: the chain's folders are deleted
    assert [p.name for p in uploads.iterdir()] == [json.loads(record(redis_url)["steps"])[0][2].rsplit("/", 1)[1]]


def test_a_store_never_lowers_the_record_and_says_what_it_cannot_load(service, redis_url, tiny_model):
    """The old store reset a record it could not load to version 0 (and served the model's own weights), over the
    newer version another cluster was still serving."""
    data = (tiny_model / "model.safetensors").read_bytes()
    old = Store(redis_url, PREFIX)  # no FARM_UPLOADS_DIR: the upload lives in this cluster's object store only
    old.commit(7, ("bytes", [bucket(data)]))
    new = Store(redis_url, PREFIX)
    version, source, lost = new.current()
    assert (version, source) == (0, None)
    assert "version 7 cannot be loaded" in lost and "FARM_UPLOADS_DIR" in lost
    assert record(redis_url)["version"] == "7"  # untouched
    with pytest.raises(ValueError, match="version 7 was committed meanwhile"):
        new.commit(6, ("path", str(tiny_model)))
    assert record(redis_url)["version"] == "7"

    new.commit(8, ("path", str(tiny_model)))  # a newer push recovers
    assert new.current() == (8, ("path", str(tiny_model)), None)
    assert old.current()[:2] == (8, ("path", str(tiny_model)))  # the old cluster follows the record
    with pytest.raises(ValueError, match="version 8 is committed"):
        old.commit(7, ("bytes", [bucket(data)]))


@pytest.fixture
def lost_app(service, tiny_model, tmp_path):
    """An app started on a Redis whose record names an upload it cannot have: as a new cluster after an upgrade."""
    embedded = EmbeddedRedis(tmp_path / "redis")
    url = embedded.start()
    redis.Redis.from_url(url).hset(
        weights_key("farm:lost"), mapping={"version": 7, "kind": "bytes", "path": "", "chain_bytes": 0}
    )
    with second_app(service, "lost", model=str(tiny_model), replicas=1, redis_url=url) as app:
        yield app
    embedded.stop()


def test_a_cluster_without_the_committed_weights_is_not_ready_and_generates_nothing(lost_app, tiny_model):
    """The old store reset the record to version 0: the app was ready and sampled from the model's own weights."""
    r = wait_until(
        lambda: (r := httpx.get(f"{lost_app}/readyz", timeout=30)).status_code == 503 and "7" in r.text and r,
        "readyz naming the lost version",
    )
    assert "committed weight version 7 cannot be loaded" in json.dumps(r.json())
    lost = [d for d in r.json()["detail"] if d["field"] == "weights"]  # what `farm serve` prints at once, with the fix
    assert len(lost) == 1 and "version 7 cannot be loaded" in lost[0]["message"]
    out = httpx.post(f"{lost_app}/v1/rollouts", json=greedy([[40, 41]]), timeout=60)
    assert out.status_code == 503 and "version 7 cannot be loaded" in out.json()["error"], out.text
    assert push_path(lost_app, tiny_model, 7).status_code == 200  # the trainer pushes it again
    wait_until(lambda: httpx.get(f"{lost_app}/readyz", timeout=30).status_code == 200, "ready after the push")
    assert all(s["weights_lost"] is None and s["weight_version"] == 7 for s in replicas(lost_app))
    out = httpx.post(f"{lost_app}/v1/rollouts", json=greedy([[40, 41]]), headers=AUTH, timeout=60)
    assert out.status_code == 200 and out.json()["groups"][0]["samples"][0]["weight_version"] == 7
