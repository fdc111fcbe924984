"""FARM_FRONT=fused (the default): every engine replica is its own HTTP ingress.

The split front sends each request across two Ray hops (Serve's proxy -> the ingress replica -> an engine
replica), and each hop costs CPU on the cores the engine computes on. Fused, the engine deployment is the Serve
application's ingress: Serve's proxy (or, with FARM_HTTP_PROXY=haproxy, HAProxy straight from the socket) hands the
request to an engine replica, whose routes are the same (rollout_farm/services/api/) on the same domain objects
(rollout_farm/services/api/ingress.py's Ingress, built in the replica as its `front`). What changes is Replicas.call:
a call of one replica's worth runs on this replica's own engine, in process (LocalFirst). A session's turn runs here
when this replica is the session's home, else on its home (sticky, Serve's multiplexing, as the split front does).
Calls every replica must answer (pushes, control, health) go to this deployment's own handle; a rollout split into
chunks runs its first chunk here and the rest through that handle, over Serve's gRPC transport.
"""

from __future__ import annotations

import asyncio
import copy
import inspect

from ray import serve

from rollout_farm.services.api.ingress import Ingress
from rollout_farm.services.config.settings import ServiceSettings
from rollout_farm.services.replica.engine_server import EngineServer
from rollout_farm.services.replica.handle import ReplicaCall, Replicas

DEPLOYMENT = "engine"
COPIED = {"chat_tokenizer"}  # answers that are the engine's own objects, which the caller gets a copy of


class LocalFirst(Replicas):
    """The engine replicas as a fused replica sees them: itself first, the others over Ray."""

    def __init__(self, handle, server: EngineServer):
        super().__init__(handle)
        self.server = server

    def call(self, method: str, *args, key: str | None = None, local: bool = True) -> ReplicaCall:
        """`method` on this replica's engine, in process (cancel() cancels its task, as Serve does a call's); through
        the deployment's handle as the split front does with `local=False`, or for a session (`key`) whose home is
        another replica or none yet (Serve's multiplexing then picks its home)."""
        if not local or (key is not None and key not in self.server.homes):
            return super().call(method, *args, key=key)
        answer = getattr(self.server, method)(*args)
        if method in COPIED:  # over Ray the caller gets a copy; the engine thread uses its own (not thread-safe)
            answer = copy.deepcopy(answer)
        task = asyncio.ensure_future(answer) if inspect.isawaitable(answer) else _done(answer)
        return ReplicaCall(task, method)


def _done(value) -> asyncio.Future:
    future = asyncio.get_running_loop().create_future()
    future.set_result(value)
    return future


class FusedReplica(EngineServer):
    """An engine replica that serves the farm's HTTP routes too (the app's ingress deployment when FARM_FRONT=fused)."""

    async def __init__(self, settings: ServiceSettings):
        await super().__init__(settings)
        # Over Serve's gRPC transport, not Ray actor calls: under load, an actor call from one fused replica to another
        # was accepted by its target and never answered (docs/deploy.md, "The HTTP front").
        peers = serve.get_deployment_handle(DEPLOYMENT, settings.app_name).options(_by_reference=False)
        self.front = await Ingress.build(LocalFirst(peers, self), settings, deployment=DEPLOYMENT)

    def local_metrics(self) -> tuple[str, str]:
        """(this replica's id, its Prometheus text): asked of every replica by a scrape (Ingress.ingress_metrics)."""
        return self.front.local_metrics()
