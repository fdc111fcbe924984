"""The adapter verbs of an engine replica (EngineServer inherits them): the two phases of an adapter push (stage,
commit; discard on a refusal anywhere), retiring a version, and loading a resident version this replica lacks (it
started after the push, or it evicted the version) from the bodies in Redis before it serves it.

Each replica computes the adapter's policy digest from the bytes it loaded and the base weights it serves
(rollout_farm/services/adapters/digest.py): the ingress commits only when every replica computed the one digest.
Expected refusals are returned, not raised (Serve logs every exception a replica method raises with a traceback)."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
from typing import TYPE_CHECKING

from rollout_farm.services import protocol as P
from rollout_farm.services.adapters import probe as probes
from rollout_farm.services.adapters.digest import adapter_digest
from rollout_farm.services.adapters.peft_format import AdapterInvalid, read_config
from rollout_farm.services.engine import WeightsRejected
from rollout_farm.services.errors import Conflict, EngineVerbMissing, Invalid, NotSupported
from rollout_farm.services.weights.buckets import views
from rollout_farm.services.weights.checks import WeightsError
from rollout_farm.services.weights.manifest import default_hash, digest, tensor_bytes

if TYPE_CHECKING:
    from rollout_farm.services.engine import Engine
    from rollout_farm.services.settings import ServiceSettings

log = logging.getLogger("farm.service")


def read_adapter(body: bytes) -> dict:
    """An adapter's tensors from its safetensors bytes; Invalid naming `adapter_model` when they are malformed."""
    try:
        tensors, _ = views(body)
    except WeightsError as e:
        raise Invalid([{"field": "adapter_model", "message": p} for p in e.problems]) from None
    return tensors


def adapter_checksums(tensors: dict) -> tuple[str, dict[str, str]]:
    algorithm = default_hash()
    return algorithm, {n: digest(algorithm, tensor_bytes(t)) for n, t in tensors.items()}


def adapter_store(settings: ServiceSettings) -> tuple[object, str]:
    """A sync Redis client and the key prefix, for the adapter bodies a replica loads."""
    import redis

    from rollout_farm.services.state.redis_client import prefix

    if not settings.redis_url:  # an engine replica outside `farm serve` (no state): it loads no adapter from Redis
        return None, prefix(settings.app_name)
    r = redis.Redis.from_url(settings.redis_url, decode_responses=True, socket_connect_timeout=2, socket_timeout=10)
    return r, prefix(settings.app_name)


def adapter_gone(ref: P.AdapterRef) -> Conflict:
    """A version retired or evicted while the request waited for it: a 409, never another policy."""
    return Conflict(
        f"version {ref.version} of adapter {ref.name!r} was retired or left the resident window while this request "
        "waited: ask for a newer version (GET /v1/adapters/{name} lists the resident ones)",
        [{"field": "adapter.version", "message": "no longer resident"}],
    )


class PolicyStamp:
    """The policy of a rollout's samples: the base (version and digest) served when it started, and its adapter with
    the digest this replica computed from the bytes it loaded (never the ingress's expectation: the ingress checks
    the one against the other, rollout_farm/services/rollout/fanout.py)."""

    def __init__(self, base_version: int, base_digest: str | None, adapter: tuple[P.AdapterRef, str] | None):
        self.base_version, self.base_digest, self.adapter = base_version, base_digest, adapter

    def stamp(self, groups):
        """Every sample of `groups` with its policy; passes a replica's expected answer (not groups) through."""
        if not isinstance(groups, list):
            return groups
        for group in groups:
            for s in group.samples:
                base_digest = self.base_digest if s.weight_version == self.base_version else None
                if self.adapter is None:
                    s.policy = P.Policy(base_version=s.weight_version, digest=base_digest)
                else:
                    ref, digest = self.adapter
                    s.policy = P.Policy(
                        base_version=s.weight_version, adapter=ref.name, adapter_version=ref.version, digest=digest
                    )
        return groups


class ReplicaAdapters:
    """Set by EngineServer.__init__."""

    engine: Engine
    settings: ServiceSettings
    adapter_bodies: object  # a sync Redis client (rollout_farm/services/adapters/registry.py's keys)
    adapter_prefix: str
    adapter_lock: asyncio.Lock
    # key -> (the adapter digest this replica computed when it staged it, the base digest it was computed on)
    adapter_digests: dict[str, tuple[str, str | None]]

    def policy_of(self, adapter: tuple[P.AdapterRef, str] | None) -> PolicyStamp:
        """The stamp of a rollout's samples; `adapter` is (the exact version, the digest this replica holds)."""
        return PolicyStamp(*self.engine.served_base(), adapter)

    async def stage_adapter(
        self, key: str, config_json: str, body: bytes, probe_json: str | None = None
    ) -> str | Invalid | Conflict:
        """Phase one: check the adapter against the served model and hold it; its digest as this replica computes
        it. With a probe (probe.py), the staged adapter must compute the pusher's logprobs. An adapter that does not
        fit, or fails its probe, is Invalid (422), returned."""
        try:
            return await asyncio.to_thread(self._stage_adapter, key, config_json, body, probe_json)
        except (Invalid, Conflict, NotSupported) as e:
            return e

    def _stage_adapter(self, key: str, config_json: str, body: bytes, probe_json: str | None = None) -> str:
        if not self.engine.serves_adapters:
            raise NotSupported(f"the {type(self.engine).__name__} engine serves no adapters: use FARM_ENGINE=torch")
        try:
            config = read_config(config_json)
            tensors = {n: t.clone() for n, t in read_adapter(body).items()}
            hash_name, sums = adapter_checksums(tensors)
            self.engine.stage_adapter(key, config, tensors)
        except AdapterInvalid as e:
            raise Invalid(e.problems, "the adapter does not fit the served model: fix the named fields") from None
        except WeightsRejected as e:
            raise Invalid([{"field": "adapter_model", "message": str(e)}]) from None
        except EngineVerbMissing as e:
            raise NotSupported(str(e)) from None
        except (ValueError, TypeError) as e:  # a config field of the wrong type
            raise Invalid([{"field": "adapter_config", "message": str(e)}]) from None
        if probe_json is not None:
            from rollout_farm.services.replica.weight_verbs import replica_id

            probe = probes.parse(probe_json)
            try:
                probes.in_vocabulary(probe, self.engine.vocab_size())
                probes.check(probe, self.engine.score_staged_adapter(key, probe.sequences), replica_id())
            except Invalid:
                self.engine.discard_adapter(key)
                raise
        base = self.engine.base_digest
        digest = adapter_digest(base or "", config.canonical(), hash_name, sums)
        self.adapter_digests[key] = (digest, base)
        return digest

    async def commit_adapter(self, key: str) -> None:
        self.engine.commit_adapter(key)

    async def discard_adapter(self, key: str) -> None:
        self.engine.discard_adapter(key)
        if key not in self.engine.resident_adapters():
            self.adapter_digests.pop(key, None)

    async def retire_adapter(self, key: str) -> None:
        """Unload now, or when the last call using it ends."""
        self.engine.retire_adapter(key)
        self.adapter_digests.pop(key, None)

    async def resident_adapters(self) -> tuple[str, list[str]]:
        from rollout_farm.services.replica.weight_verbs import replica_id

        return replica_id(), sorted(self.engine.resident_adapters())

    def _held(self, key: str, expected_digest: str) -> str | None:
        """The digest this replica holds for resident `key` when it is still right: computed on the base served
        now, and the one the push recorded. An adapter whose base changed under it is retired here (a Conflict);
        one whose bytes differ from the recorded ones too. None when `key` is not resident."""
        if key not in self.engine.resident_adapters() or key not in self.adapter_digests:
            return None
        digest, base = self.adapter_digests[key]
        if base != self.engine.base_digest or digest != expected_digest:
            self.engine.retire_adapter(key)
            self.adapter_digests.pop(key, None)
            why = (
                "the base weights changed since it was loaded"
                if base != self.engine.base_digest
                else (f"this replica holds digest {digest}, the push recorded {expected_digest}")
            )
            log.error("adapter_policy_mismatch", extra={"adapter": key, "why": why})
            raise Conflict(
                f"adapter {key} is not served here as it was pushed: {why}; it was unloaded. Push the adapter again "
                "(a new version) on the base served now",
                [{"field": "adapter.version", "message": "its policy on this replica is not the pushed one"}],
            )
        return digest

    async def ensure_adapter(self, ref: P.AdapterRef, expected_digest: str) -> tuple[str, str]:
        """(the resident key of `ref`, an exact version the ingress resolved, and the digest this replica computed
        for it), loaded from Redis first when this replica lacks it. Conflict when its body is gone (it left the
        window meanwhile) or when the digest this replica computes differs from the one the push recorded (the base
        weights changed under it, or the bytes did)."""
        key = ref.key()
        if (held := self._held(key, expected_digest)) is not None:
            return key, held
        async with self.adapter_lock:
            if (held := self._held(key, expected_digest)) is not None:
                return key, held
            name = f"{self.adapter_prefix}:adapter:{ref.name}"
            raw, stored = await asyncio.to_thread(
                lambda: (
                    self.adapter_bodies.hget(name, f"v{ref.version}"),
                    self.adapter_bodies.get(f"{name}:v{ref.version}:body"),
                )
            )
            if raw is None or stored is None:
                raise adapter_gone(ref)
            record, stored = P.AdapterVersion.model_validate_json(raw), json.loads(stored)
            body = base64.b64decode(stored["body"])
            if key in self.engine.resident_adapters(include_retiring=True):  # still used by a call: not replaced
                raise adapter_gone(ref)
            got = await asyncio.to_thread(self._stage_adapter, key, stored["config"], body)
            if got != record.digest or got != expected_digest:
                self.engine.discard_adapter(key)
                self.adapter_digests.pop(key, None)
                raise Conflict(
                    f"adapter {key} was pushed with digest {record.digest}, but on this replica's base weights it is "
                    f"{got}: the base changed since the push; push the adapter again",
                    [{"field": "adapter.version", "message": "its digest does not match the base served now"}],
                )
            self.engine.commit_adapter(key)
            log.info("adapter_loaded", extra={"adapter": key, "digest": got})
            return key, got
