"""The committed weight version and where its weights are, so that a new or restarted replica can catch up.

A deployment-scoped actor of the engine deployment (Serve recreates it with the deployment). The source is
("bytes", [ref]) for an HTTP push (ray.put here, so the store owns a copy that outlives the sender) or
("path", folder) for a push from shared storage.
"""

from __future__ import annotations

import ray


@ray.remote(num_cpus=0)
class WeightStore:
    def __init__(self):
        self.version, self.source = 0, None

    def commit(self, version: int, source: tuple) -> None:
        if version >= self.version:  # equal: a push retried after its commit failed
            if source[0] == "bytes":
                source = ("bytes", [ray.put(ray.get(source[1][0]))])
            self.version, self.source = version, source

    def current(self) -> tuple[int, tuple | None]:
        return self.version, self.source
