"""The committed weight version and where its weights are, so that a new or restarted replica can catch up.

A deployment-scoped actor of the engine deployment (Serve recreates it with the deployment). Sources:
  ("bytes", [ref, ...])                  an HTTP push: its buckets (numpy arrays) in Ray's object store
  ("delta", {"base", "refs", "bytes"})   a push with a base version (bucketed or delta)
  ("path", folder)                       a push from shared storage
The store owns its own copy of an upload's buckets: Ray removed ray.put's `_owner` in 2.56, so an object lives only
as long as the process that put it, and the ingress that did may die. It takes that copy while the replicas stage
(`hold`: one memcpy per bucket, since ray.get of a numpy array is a view), off the push's critical path. After a push
with a base version the source is ("chain", [(version, source), ...]): the last full version (source None for the
model folder, version 0), then each delta, which a starting replica applies in order. The chain's delta bytes go to
Redis, and the ingress asks for a full push once they would pass the model's size (the store holds at most about
two models).

The record is also written to Redis (farm:<app>:weights: version, kind, path, chain_bytes), where every ingress
replica reads the committed version, and from where a store started after a restart of Ray takes it back. A folder
is still there then; an upload lived in Ray's object store and is gone with it: the store says so in the log and the
service starts again from the model's own weights at version 0 (push by path to survive a restart of Ray; a folder
that is gone counts as lost too).
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
        self.version, self.source, self.held = 0, None, None
        record = self.r.hgetall(self.key)
        if record.get("kind") == "path" and pathlib.Path(record["path"]).is_dir():
            self.version, self.source = int(record["version"]), ("path", record["path"])
        elif record and int(record.get("version", 0)) > 0:
            log.warning(
                "committed_weights_lost",
                extra={"version": int(record["version"]), "kind": record.get("kind"), "serving": 0},
            )
            self.r.hset(self.key, mapping={"version": 0, "kind": "base", "path": "", "chain_bytes": 0})

    def hold(self, version: int, source: tuple) -> None:
        """Copy an upload's buckets into objects this store owns, while the replicas stage them."""
        if source[0] in ("bytes", "delta"):
            refs = _refs(source)
            self.held = (version, refs, [ray.put(ray.get(ref)) for ref in refs])

    def _owned(self, version: int, refs: list) -> list:
        held, self.held = self.held, None
        if held and held[0] == version and held[1] == refs:
            return held[2]
        return [ray.put(ray.get(ref)) for ref in refs]

    def commit(self, version: int, source: tuple) -> None:
        if version < self.version:  # equal: a push retried after its commit failed
            return
        kind, chain_bytes = source[0], 0
        if kind == "bytes":
            source = ("bytes", self._owned(version, source[1]))
        elif kind == "delta":
            where = source[1]
            steps = list(self.source[1]) if self.source and self.source[0] == "chain" else [(self.version, self.source)]
            if len(steps) > 1 and steps[-1][0] == version:  # the same push retried after its commit failed
                steps.pop()
            if steps[-1][0] != where["base"]:
                raise ValueError(
                    f"the store holds version {steps[-1][0]}, not the push's base {where['base']}: send a full push"
                )
            steps.append((version, ("delta", {**where, "refs": self._owned(version, where["refs"])})))
            chain_bytes = sum(step[1]["bytes"] for _, step in steps[1:])
            source, kind = ("chain", steps), "chain"
        path = source[1] if kind == "path" else ""
        self.r.hset(self.key, mapping={"version": version, "kind": kind, "path": path, "chain_bytes": chain_bytes})
        self.version, self.source = version, source

    def current(self) -> tuple[int, tuple | None]:
        return self.version, self.source


def _refs(source: tuple) -> list:
    return source[1] if source[0] == "bytes" else source[1]["refs"]
