"""The committed weight version and where its weights are, so that a new or restarted replica can catch up.

A deployment-scoped actor of the engine deployment (Serve recreates it with the deployment). Sources:
  ("bytes", [ref, ...])                  an HTTP push: its buckets (numpy arrays) in Ray's object store
  ("delta", {"base", "refs", "bytes"})   a push with a base version (bucketed or delta)
  ("path", folder)                       a push from shared storage
The store owns its own copy of an upload's buckets: Ray removed ray.put's `_owner` in 2.56, so an object lives only
as long as the process that put it, and the ingress that did may die. It takes that copy while the replicas stage
(`hold`: one memcpy per bucket as it arrives, since ray.get of a numpy array is a view), off the push's critical
path. After a push with a base version the source is ("chain", [(version, source), ...]): the last full version
(source None for the model folder, version 0), then each delta, which a starting replica applies in order. The
chain's delta bytes go to Redis, and the ingress asks for a full push once they would pass the model's size (the
store holds at most about two models).

The record is also written to Redis (farm:<app>:weights: version, kind, path, chain_bytes, steps), where every
ingress replica reads the committed version, and from where a store of another cluster sharing the Redis (a
RayService upgrade, a restart of Ray) takes it. The record is the truth: a store never writes an older version over
it (a compare-and-set in Redis), and one that cannot load the recorded version does not fall back to the model's own
weights: it reports the version `lost`, with the reason, and replicas refuse rollouts that need it and are not ready
(until a push of that version or a newer one).

A folder pushed by path is still there after a restart. An upload lives in Ray's object store and goes with it,
unless FARM_UPLOADS_DIR is set: then each upload's buckets (each a safetensors file) are written under it before the
commit, and `steps` in the record lists the folders a new store reads them back from (the Helm chart puts it on the
shared volume; `farm serve` with its embedded Redis defaults it to the state folder's `uploads`). The folder holds
the committed version's steps only: each commit deletes the ones it no longer needs, and a new store deletes what
no record names (a push that failed after its write, a write cut by a crash) once it is ORPHAN_AGE_S old, so that
a push another cluster is writing meanwhile keeps its folder.
"""

from __future__ import annotations

import json
import logging
import pathlib
import re
import shutil
import time
import uuid

import numpy as np
import ray
import redis

log = logging.getLogger("farm.service")
ORPHAN_AGE_S = 3600.0  # a folder under FARM_UPLOADS_DIR that no record names is deleted once this old
UPLOAD_NAME = re.compile(r"^[0-9a-f]{32}(\.partial)?$")  # what persist() names a folder

# Writes the record unless it holds a newer version; returns the version it holds afterwards.
COMPARE_AND_SET = """
local held = tonumber(redis.call('HGET', KEYS[1], 'version') or '0')
if held > tonumber(ARGV[1]) then return held end
redis.call('HSET', KEYS[1], unpack(ARGV, 2))
return tonumber(ARGV[1])
"""


def weights_key(prefix: str) -> str:
    return f"{prefix}:weights"


def persist(folder: pathlib.Path, refs: list) -> str:
    """Each bucket as a safetensors file in a new folder under `folder`; the folder, once every file is written."""
    out = folder / f"{uuid.uuid4().hex}.partial"
    out.mkdir(parents=True)
    for i, ref in enumerate(refs):
        np.asarray(ray.get(ref)).tofile(out / f"bucket-{i:05d}.safetensors")
    done = out.with_suffix("")
    out.rename(done)
    return str(done)


def sweep(uploads: pathlib.Path, keep: set[str], older_than_s: float = ORPHAN_AGE_S) -> None:
    """Delete the folders persist() wrote under `uploads` whose names are not in `keep` (each a uuid: a name is
    unique, however the folder above it is spelled) and that are older than `older_than_s`."""
    now = time.time()
    for folder in uploads.iterdir() if uploads.is_dir() else []:
        if not UPLOAD_NAME.match(folder.name) or folder.name in keep:
            continue
        try:
            if now - folder.stat().st_mtime > older_than_s:
                shutil.rmtree(folder, ignore_errors=True)
        except FileNotFoundError:  # deleted meanwhile (by the store that wrote it)
            continue


def read_back(folder: str) -> list:
    """A persisted upload's buckets, in order, as objects in Ray's object store."""
    files = sorted(pathlib.Path(folder).glob("bucket-*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no buckets in {folder}")
    return [ray.put(np.fromfile(f, np.uint8)) for f in files]


class Store:
    def __init__(self, redis_url: str, prefix: str, uploads_dir: str | None = None):
        self.r = redis.Redis.from_url(redis_url, decode_responses=True, socket_connect_timeout=2, socket_timeout=10)
        self.key = weights_key(prefix)
        self.uploads = pathlib.Path(uploads_dir) if uploads_dir else None
        self.version, self.source, self.held = 0, None, None
        self.steps: list = []  # [[version, kind, folder or path, bytes]]: where each step of the source is on disk
        self.lost: str | None = None  # why the recorded version cannot be loaded
        self._cas = self.r.register_script(COMPARE_AND_SET)
        self.follow()
        if self.uploads:
            named = json.loads(self.r.hget(self.key, "steps") or "[]")
            sweep(self.uploads, {pathlib.Path(s[2]).name for s in named if s[2]})

    def follow(self) -> None:
        """Take the recorded version if it is newer than the one held: written by this store's earlier life or by
        another cluster on the same Redis. One that cannot be loaded is `lost`, and the one held stays."""
        record = self.r.hgetall(self.key)
        version = int(record.get("version") or 0)
        if version <= self.version:
            return
        try:
            self.source, self.steps = restore(record), json.loads(record.get("steps") or "[]")
            self.version, self.lost = version, None
            log.info("committed_weights_loaded", extra={"version": version, "kind": record.get("kind")})
        except LookupError as e:
            if self.lost is None:
                log.error("committed_weights_lost", extra={"version": version, "reason": str(e)})
            self.lost = (
                f"committed weight version {version} cannot be loaded ({e}); this cluster serves no rollouts until "
                f"a push of version {version} or newer"
            )

    def hold(self, version: int, source: tuple) -> None:
        """Copy an upload's buckets into objects this store owns, while the replicas stage them. The ingress calls
        it as the buckets arrive, with the buckets so far: only those not copied yet are copied."""
        if source[0] in ("bytes", "delta"):
            refs = list(_refs(source))
            _, had, copies = self.held if self.held and self.held[0] == version else (version, [], [])
            if had[: len(refs)] != refs[: len(had)]:  # another upload of this version: start again
                had, copies = [], []
            if len(refs) > len(had):
                self.held = (version, refs, copies + [ray.put(ray.get(ref)) for ref in refs[len(had) :]])

    def _owned(self, version: int, refs: list) -> list:
        held, self.held = self.held, None
        if held and held[0] == version and held[1] == refs:
            return held[2]
        return [ray.put(ray.get(ref)) for ref in refs]

    def commit(self, version: int, source: tuple) -> None:
        self.follow()
        if version < self.version:  # equal: a push retried after its commit failed
            raise ValueError(f"version {self.version} is committed (by this cluster or another): push a newer one")
        kind, chain_bytes, steps = source[0], 0, [[version, "path", source[1], 0]] if source[0] == "path" else []
        if kind == "bytes":
            source = ("bytes", self._owned(version, source[1]))
            steps = [[version, "bytes", self._persisted(source[1]), 0]]
        elif kind == "delta":
            where = source[1]
            chain = list(self.source[1]) if self.source and self.source[0] == "chain" else [(self.version, self.source)]
            steps = [list(s) for s in self.steps] or [[self.version, "base", None, 0]]
            if len(chain) > 1 and chain[-1][0] == version:  # the same push retried after its commit failed
                chain.pop(), steps.pop()
            if chain[-1][0] != where["base"]:
                raise ValueError(
                    f"the store holds version {chain[-1][0]}, not the push's base {where['base']}: send a full push"
                )
            refs = self._owned(version, where["refs"])
            chain.append((version, ("delta", {**where, "refs": refs})))
            steps.append([version, "delta", self._persisted(refs), where["bytes"]])
            chain_bytes = sum(step[1]["bytes"] for _, step in chain[1:])
            source, kind = ("chain", chain), "chain"
        path = source[1] if kind == "path" else ""
        record = {"version": version, "kind": kind, "path": path, "chain_bytes": chain_bytes}
        record["steps"] = json.dumps(steps if all(s[2] or s[1] == "base" for s in steps) else [])
        held = self._cas(keys=[self.key], args=[version, *[x for kv in record.items() for x in kv]])
        if held != version:
            raise ValueError(f"version {held} was committed meanwhile (by another cluster): push a newer one")
        old = {s[2] for s in self.steps if s[1] in ("bytes", "delta")}
        self.version, self.source, self.steps, self.lost = version, source, steps, None
        self._forget(old - {s[2] for s in steps})

    def _persisted(self, refs: list) -> str | None:
        """The folder an upload is written to under FARM_UPLOADS_DIR, before the commit; None without it."""
        return persist(self.uploads, refs) if self.uploads else None

    def _forget(self, folders: set) -> None:
        """Delete persisted uploads no step refers to any more."""
        for folder in folders:
            if folder and self.uploads and pathlib.Path(folder).parent == self.uploads:
                shutil.rmtree(folder, ignore_errors=True)

    def current(self) -> tuple[int, tuple | None, str | None]:
        """(the version to serve, its source, why a newer recorded version cannot be loaded or None)."""
        self.follow()
        return self.version, self.source, self.lost


def restore(record: dict) -> tuple | None:
    """The source of a recorded version, read back from disk; LookupError naming what is missing."""
    kind = record.get("kind")
    if kind == "path":
        if not pathlib.Path(record["path"]).is_dir():
            raise LookupError(f"its folder {record['path']} is gone")
        return ("path", record["path"])
    steps = json.loads(record.get("steps") or "[]")
    if not steps:
        raise LookupError(
            f"it was an upload ({kind}), held only in the object store of the cluster that took it: set "
            "FARM_UPLOADS_DIR to keep uploads on disk, or push by path"
        )
    chain = []
    for version, step_kind, where, size in steps:
        if where and not pathlib.Path(where).is_dir():
            raise LookupError(f"the folder of version {version}, {where}, is gone")
        if step_kind == "base":
            chain.append((version, None))
        elif step_kind == "path":
            chain.append((version, ("path", where)))
        elif step_kind == "bytes":
            chain.append((version, ("bytes", read_back(where))))
        else:
            delta = {"base": chain[-1][0], "refs": read_back(where), "bytes": size}
            chain.append((version, ("delta", delta)))
    return chain[0][1] if kind != "chain" else ("chain", chain)


def _refs(source: tuple) -> list:
    return source[1] if source[0] == "bytes" else source[1]["refs"]


WeightStore = ray.remote(num_cpus=0)(Store)
