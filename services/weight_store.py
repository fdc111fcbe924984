"""The committed weight version and where its weights are, so that a new or restarted replica can catch up.

A deployment-scoped actor of the engine deployment (Serve recreates it with the deployment). The source is
("bytes", [ref]) for an HTTP push (ray.put here, so the store owns a copy that outlives the sender) or
("path", folder) for a push from shared storage.

The record is also written to Redis (farm:<app>:weights: version, kind, path), where every ingress replica reads
the committed version, and from where a store started after a restart of Ray takes it back. A folder is still
there then; an upload lived in Ray's object store and is gone with it: the store says so in the log and the
service starts again from the model's own weights at version 0 (push by path to survive a restart of Ray; a
folder that is gone counts as lost too).
"""

from __future__ import annotations

import logging
import pathlib

import ray
import redis

log = logging.getLogger("farm.service")


def weights_key(prefix: str) -> str:
    return f"{prefix}:weights"


@ray.remote(num_cpus=0)
class WeightStore:
    def __init__(self, redis_url: str, prefix: str):
        self.r = redis.Redis.from_url(redis_url, decode_responses=True, socket_connect_timeout=2, socket_timeout=10)
        self.key = weights_key(prefix)
        self.version, self.source = 0, None
        record = self.r.hgetall(self.key)
        if record.get("kind") == "path" and pathlib.Path(record["path"]).is_dir():
            self.version, self.source = int(record["version"]), ("path", record["path"])
        elif record and int(record.get("version", 0)) > 0:
            log.warning(
                "committed_weights_lost",
                extra={"version": int(record["version"]), "kind": record.get("kind"), "serving": 0},
            )
            self.r.hset(self.key, mapping={"version": 0, "kind": "base", "path": ""})

    def commit(self, version: int, source: tuple) -> None:
        if version >= self.version:  # equal: a push retried after its commit failed
            if source[0] == "bytes":
                source = ("bytes", [ray.put(ray.get(source[1][0]))])
            path = source[1] if source[0] == "path" else ""
            self.r.hset(self.key, mapping={"version": version, "kind": source[0], "path": path})
            self.version, self.source = version, source

    def current(self) -> tuple[int, tuple | None]:
        return self.version, self.source
