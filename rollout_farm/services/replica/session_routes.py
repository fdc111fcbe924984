"""Sticky sessions: a session's turns go to one engine replica while it is healthy, so the KV cache the replica
keeps for it (rollout_farm/services/engine/torch/session_cache.py) serves the next turn.

Built on Ray Serve's model multiplexing, not a router of our own: the ingress calls the replicas with the session's
id as the multiplexed model id (Replicas.call's `key`), Serve's router sends it to a replica that has "loaded" it,
and a replica loads it by calling its `session_route` for it. A replica is the home of at most FARM_SESSIONS_PER_
REPLICA sessions (least recently used first out); an evicted session's KV cache is dropped with it. When the home
replica dies, Serve routes the session to another one, which prefills the whole session once and is its home from
then on.
"""

from __future__ import annotations

from ray import serve


class SessionRoute:
    """A session this replica is the home of (Serve's multiplexed "model"); evicted, it drops the session's cache."""

    def __init__(self, key: str, engine, homes: set[str]):
        self.key, self.engine, self.homes = key, engine, homes
        homes.add(key)

    def __del__(self):
        self.homes.discard(self.key)
        self.engine.forget_session(self.key)


def session_routes(engine, per_replica: int, homes: set[str]):
    """The replica's `session_route(key)`: makes the replica the key's home (Serve then routes the key here).
    `homes` holds the keys it is the home of now (a fused front runs their turns in process: front/fused.py)."""

    async def session_route(key: str) -> SessionRoute:
        return SessionRoute(key, engine, homes)

    return serve.multiplexed(max_num_models_per_replica=per_replica)(session_route)
