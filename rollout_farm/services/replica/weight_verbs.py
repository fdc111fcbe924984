"""The weight verbs of an engine replica (EngineServer inherits them): catch-up to the committed version from the
WeightStore, the two phases of a push (stage, with an upload's buckets staged one by one as they arrive, and
commit), the record a starting replica loads, and the trainer's NCCL transport. Expected refusals (weights refused,
a base that does not fit, a probe the staged weights fail, an engine without NCCL) are returned, not raised: Serve
logs every exception a replica method raises with its traceback.

A push's probe (rollout_farm/services/weights/probe.py) is scored in phase one, on the staged weights, which no
request sees: the model's own forward pass with the staged tensors put in place of its parameters for the call
(torch.func.functional_call), under the model lock that keeps every decode step and scoring pass out meanwhile. No
copy of the weights is made (the staged tensors are already on the device), nothing is swapped in and rolled back,
and the served weights never change: a mismatch on any replica refuses the push before any commit."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING

from ray import serve

from rollout_farm.services import protocol as P
from rollout_farm.services.engine import WeightsRejected
from rollout_farm.services.errors import (
    Conflict,
    EngineVerbMissing,
    Invalid,
    NotSupported,
    Unavailable,
    VersionNotReached,
)
from rollout_farm.services.weights import probe as probes

if TYPE_CHECKING:
    from rollout_farm.services.config.settings import ServiceSettings
    from rollout_farm.services.engine import Engine
    from rollout_farm.services.weights.manifest import Manifest
    from rollout_farm.services.weights.stage import Staging

log = logging.getLogger("farm.service")


def replica_id() -> str:
    return serve.get_replica_context().replica_id.unique_id


class ReplicaWeights:
    """Set by EngineServer.__init__."""

    engine: Engine
    settings: ServiceSettings
    catch_up_lock: asyncio.Lock
    pending_version: int  # a commit in progress on this replica
    weights_lost: str | None  # the WeightStore's reason, while the committed version cannot be loaded
    staging: Staging | None = None  # the upload being staged bucket by bucket (one at a time: the push lock)

    async def catch_up(self, min_version: int) -> None:
        """Load the committed version from the store if it is newer; wait up to FARM_MIN_VERSION_WAIT_S for
        min_version."""
        deadline = time.monotonic() + self.settings.min_version_wait_s
        while True:
            async with self.catch_up_lock:
                store = serve.get_deployment_actor("weights")  # looked up each time: Serve may recreate it
                version, source, self.weights_lost = await store.current.remote()
                if version > self.engine.weight_version:
                    await self.commit(version, None, source)
                    log.info("caught_up", extra={"version": version})
            if self.engine.weight_version >= min_version:
                return
            if self.weights_lost:  # no waiting: the version needed cannot be loaded until someone pushes it again
                raise Unavailable(self.weights_lost)
            if time.monotonic() > deadline:
                raise VersionNotReached(
                    f"weight version {min_version} was not committed within FARM_MIN_VERSION_WAIT_S="
                    f"{self.settings.min_version_wait_s}; this replica serves {self.engine.weight_version}"
                )
            await asyncio.sleep(0.05)

    async def stage(
        self, source: tuple, version: int, probe_json: str | None = None
    ) -> int | Invalid | Conflict | NotSupported:
        """Phase one of a push: check and hold the weights next to the served ones, then score the push's probe on
        them, if it has one. Weights the engine refuses (e.g. NaN or inf in a tensor) are Invalid, a 422 naming the
        tensor, and so are staged weights that do not compute the probe's logprobs (naming `probe`, this replica, the
        sequence and the token); a push with a base version that does not fit the served weights is a Conflict (409)
        telling the client to send a full push; an engine that cannot score a probe is NotSupported (501). All are
        expected answers, returned, not raised (Serve logs every exception a replica method raises with its
        traceback): the ingress takes a returned error as this replica's refusal (Replicas.errors), makes every
        replica discard, and logs the push's one warning line."""
        try:
            await self._stage(source, version)
            if probe_json is not None:
                await asyncio.to_thread(self._probe, probes.parse(probe_json), version)
            return version
        except (Invalid, Conflict, NotSupported) as e:
            return e

    def _probe(self, probe: probes.Probe, version: int) -> None:
        """Invalid (naming `probe`) unless the weights staged as `version` compute the probe's logprobs."""
        probes.in_vocabulary(probe, self.engine.vocab_size())
        probes.check(probe, self._score_staged(version, probe.sequences), replica_id())

    def _score_staged(self, version: int, sequences: list[list[int]]) -> list[list[float | None]]:
        """Each sequence's logprobs under the weights staged as `version`, which no request sees (the module's
        docstring says how); NotSupported (501) for an engine that cannot (SGLang)."""
        try:
            return self.engine.score_staged_weights(version, sequences)
        except EngineVerbMissing as e:
            raise NotSupported(str(e)) from None
        except WeightsRejected as e:
            raise Invalid([{"field": "probe", "message": f"replica {replica_id()}: {e}"}]) from None

    async def stage_bucket(
        self, version: int, index: int, refs: list, manifest: Manifest | None
    ) -> int | Invalid | Conflict:
        """Phase one, early: bucket `index` (refs: its ObjectRef) of an upload of `version` that is still streaming,
        checked (checksums, NaN and inf) and held; stage() then checks the whole push. Refusals are returned, as by
        stage()."""
        from rollout_farm.services.weights.stage import Staging

        if self.staging is None or self.staging.version != version:
            self.staging = Staging(version)  # a newer push: the push lock ended the one before
        staging = self.staging
        try:
            with refused("body"):
                await asyncio.to_thread(staging.add, index, refs[0], manifest, self.engine)
        except (Invalid, Conflict) as e:
            return e
        return index

    async def _stage(self, source: tuple, version: int) -> int:
        """stage(), raising its refusals. A catch-up ("chain") first commits the versions before `version` it still
        lacks; an upload staged bucket by bucket is finished (rollout_farm/services/weights/stage.py Staging.finish)."""
        from rollout_farm.services.weights.stage import Staging

        kind, where = source
        if kind == "chain":
            *before, (last, source) = where
            for v, step in before:
                if step is not None and v > self.engine.weight_version:
                    await self._stage(step, v)
                    with refused("body"):
                        await asyncio.to_thread(self.engine.commit_weights, v, None)
            kind, where = source
        with refused("path" if kind == "path" else "body"):
            if kind == "path":
                await asyncio.to_thread(self.engine.stage_weights_from_path, where, version)
            else:
                staging = Staging(version)
                if self.staging is not None and self.staging.version == version:
                    staging, self.staging = self.staging, None
                refs = where if kind == "bytes" else where["refs"]
                tensors = await asyncio.to_thread(staging.finish, refs, self.engine, kind == "delta")
                await asyncio.to_thread(self.engine.stage_weights, tensors, version)
        return version

    async def commit(self, version: int, policy: str | None, source: tuple) -> int:
        """Phase two: serve the staged version (the ingress has recorded it in the store). A replica that
        joined after phase one stages from `source` first. A catch-up (policy None) keeps a push's policy."""
        if version <= self.engine.weight_version:
            return self.engine.weight_version
        self.pending_version = max(self.pending_version, version)
        try:
            try:
                await asyncio.to_thread(self.engine.commit_weights, version, policy)
            except WeightsRejected:  # nothing staged here: this replica started after phase one
                await self._stage(source, version)
                await asyncio.to_thread(self.engine.commit_weights, version, policy)
        finally:
            self.pending_version = self.engine.weight_version  # also when the commit failed: nothing is pending then
        return self.engine.weight_version

    async def record(self, version: int, source: tuple, hold: bool = False) -> None:
        """Make `version` the one a starting replica loads (the store belongs to this deployment). hold=True: the
        store only takes its own copy of the upload, while the replicas stage
        (rollout_farm/services/weights/store.py)."""
        store = serve.get_deployment_actor("weights")
        await (store.hold if hold else store.commit).remote(version, source)

    def discard(self, version: int) -> None:
        if self.staging is not None and self.staging.version <= version:
            self.staging = None
        self.engine.discard_weights(version)

    def weight_spec(self) -> dict:
        return self.engine.weight_spec()

    def weight_version(self) -> tuple[str, int]:
        """(this replica's id, the version it serves)."""
        return replica_id(), self.engine.weight_version

    async def init_weights_update_group(
        self, group: P.DistributedGroup, replica_ids: list[str]
    ) -> int | EngineVerbMissing:
        """Join the trainer's group at rank rank_offset + (this replica's place among replica_ids) * ranks per engine.
        Blocks (off the event loop) until the trainer and every replica have joined. An engine without the NCCL
        transport answers EngineVerbMissing (the documented 501), returned, not raised: the ingress raises it
        (Replicas.all), and Serve does not log a traceback for an expected answer."""
        rank = group.rank_offset + replica_ids.index(replica_id()) * self.engine.ranks_per_engine
        try:
            await asyncio.to_thread(
                self.engine.init_weights_update_group,
                group.master_address,
                group.master_port,
                rank,
                group.world_size,
                group.group_name,
                group.backend,
            )
        except EngineVerbMissing as e:
            return e
        return rank

    async def update_weights_from_distributed(
        self, update: P.DistributedUpdate, replica_ids: list[str]
    ) -> int | EngineVerbMissing:
        """The tensors the trainer broadcasts, as `update.version`; EngineVerbMissing returned as above."""
        try:
            await asyncio.to_thread(
                self.engine.update_weights_from_distributed,
                update.names,
                update.dtypes,
                update.shapes,
                update.version,
                update.group_name,
            )
        except EngineVerbMissing as e:
            return e
        return self.engine.weight_version


@contextlib.contextmanager
def refused(field: str):
    """Weights refused as Invalid (422, naming `field`: body or path); a base that does not fit as Conflict (409)."""
    from rollout_farm.services.weights.stage import BaseMismatch

    try:
        yield
    except WeightsRejected as e:
        raise Invalid([{"field": field, "message": str(e)}], "weights refused; the old version keeps serving") from None
    except BaseMismatch as e:
        raise Conflict(
            "the push does not apply to a replica's weights; the old version keeps serving",
            [{"field": "base", "message": str(e)}],
        ) from None
