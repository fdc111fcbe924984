"""The adapter verbs of an engine replica (EngineServer inherits them): the two phases of an adapter push (stage,
commit; discard on a refusal anywhere), retiring a version, and loading a resident version this replica lacks (it
started after the push, or it unloaded the version) from the bodies in Redis before it serves it. Loaded versions stay
within FARM_ADAPTER_BYTES_PER_REPLICA: loading one more unloads the least recently used ones no call pins
(rollout_farm/services/adapters/residency.py); with no room, the request is a 429 and a push's commit is deferred to
the first request naming it. PolicyStamp stamps each sample with its policy, or policies where it spans a commit.

Each replica computes the adapter's policy digest from the bytes it loaded and the base weights it serves
(rollout_farm/services/adapters/digest.py): the ingress commits only when every replica computed the one digest.
Expected refusals are returned, not raised (Serve logs every exception a replica method raises with a traceback)."""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import TYPE_CHECKING

from rollout_farm.services import protocol as P
from rollout_farm.services.adapters.digest import adapter_digest
from rollout_farm.services.adapters.peft_format import AdapterInvalid, read_config
from rollout_farm.services.adapters.residency import SETTING, Residency
from rollout_farm.services.engine import WeightsRejected
from rollout_farm.services.engine.base import AdapterNotResident
from rollout_farm.services.errors import Conflict, EngineVerbMissing, Invalid, NotSupported, Overloaded, Unavailable
from rollout_farm.services.weights import probe as probes
from rollout_farm.services.weights.buckets import views
from rollout_farm.services.weights.checks import WeightsError
from rollout_farm.services.weights.manifest import default_hash, digest, tensor_bytes

if TYPE_CHECKING:
    from rollout_farm.services.config.settings import ServiceSettings
    from rollout_farm.services.engine import Engine

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
    # bytes as stored: an adapter's body is its safetensors bytes (adapters/registry.py)
    r = redis.Redis.from_url(settings.redis_url, decode_responses=False, socket_connect_timeout=2, socket_timeout=10)
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
    the one against the other, rollout_farm/services/rollout/policy_check.py).

    A base sample whose tokens span a base commit ("partial") carries `policies`, one per base version among its
    tokens (P.Sample.policies), each with that version's digest (`digest_of`: the engine's recent ones). An adapter
    sample never spans one: a base push is refused while adapters are resident, and a forced one retires them, but a
    rollout already running on one keeps it pinned. If a commit still lands under an adapter's rollout (or before it
    started, after its adapter was checked), its samples were drawn on a base the adapter was not pushed on: the
    rollout is a 409, never samples of a policy nobody pushed."""

    def __init__(self, served: tuple[int, str | None], adapter: tuple[P.AdapterRef, str] | None, digest_of, on=None):
        self.base_version, self.base_digest = served
        self.adapter, self.adapter_base = adapter, on  # on: the base digest the adapter's digest was computed on
        self.digest_of = digest_of

    def _digest(self, version: int) -> str | None:
        return self.base_digest if version == self.base_version else self.digest_of(version)

    def stamp(self, groups):
        """Every sample of `groups` with its policy (and policies); passes a replica's expected answer (not groups)
        through; a Conflict for a rollout on an adapter whose base changed under it."""
        if not isinstance(groups, list):
            return groups
        for group in groups:
            for s in group.samples:
                versions = list(dict.fromkeys(s.token_weight_versions or [s.weight_version]))  # in token order
                if self.adapter is None:
                    policies = [P.Policy(base_version=v, digest=self._digest(v)) for v in versions]
                    s.policy, s.policies = policies[0], policies if len(policies) > 1 else None
                    continue
                ref, digest = self.adapter
                if versions != [self.base_version] or self.base_digest != self.adapter_base:
                    return base_changed(ref, self.base_version, versions)
                s.policy = P.Policy(
                    base_version=self.base_version, adapter=ref.name, adapter_version=ref.version, digest=digest
                )
        return groups


def base_changed(ref: P.AdapterRef, started: int, versions: list[int]) -> Conflict:
    log.error("adapter_base_changed", extra={"adapter": ref.key(), "base_versions": [started, *versions]})
    return Conflict(
        f"the base weights changed under adapter {ref.key()} while this rollout ran (base v{started}, tokens on "
        f"{', '.join(f'v{v}' for v in versions)}: a forced base push): its samples come from no pushed policy and "
        "none was delivered; push the adapter again on the base served now",
        [{"field": "adapter.version", "message": "its base changed during the rollout"}],
    )


def no_room(key: str, budget: int) -> Overloaded:
    """Loading `key` would pass the replica's byte budget, and every loaded version is in use: a 429, never another
    policy (the versions in use are unloaded once their requests end)."""
    return Overloaded(
        f"adapter {key} cannot be loaded on this replica now: the adapter versions its running requests use fill "
        f"{SETTING}={budget} bytes. Retry later (they are unloaded once their requests end), or raise {SETTING}",
        [{"field": "adapter", "message": f"no room within {SETTING}={budget}"}],
    )


class ReplicaAdapters:
    """Set by EngineServer.__init__."""

    engine: Engine
    settings: ServiceSettings
    adapter_bodies: object  # a sync Redis client (rollout_farm/services/adapters/registry.py's keys)
    adapter_prefix: str
    adapter_lock: asyncio.Lock
    # key -> (the adapter digest this replica computed when it staged it, the base digest it was computed on)
    adapter_digests: dict[str, tuple[str, str | None]]

    @functools.cached_property
    def residency(self) -> Residency:
        """The loaded versions' use clock and FARM_ADAPTER_BYTES_PER_REPLICA (rollout_farm/services/adapters/
        residency.py)."""
        return Residency(self.settings.adapter_bytes_per_replica)

    def policy_of(self, adapter: tuple[P.AdapterRef, str] | None) -> PolicyStamp:
        """The stamp of a rollout's samples; `adapter` is (the exact version, the digest this replica holds), pinned
        by the caller."""
        digest_of = getattr(self.engine, "base_digest_of", None) or (lambda version: None)
        on = self.adapter_digests.get(adapter[0].key(), (None, self.engine.base_digest))[1] if adapter else None
        return PolicyStamp(self.engine.served_base(), adapter, digest_of, on)

    def residency_state(self) -> dict:
        """ReplicaState's adapter fields: the bytes loaded now (retiring versions too) and the LRU unloads."""
        loaded = self.engine.resident_adapters(include_retiring=True)
        return {"adapter_bytes": sum(b for b, _ in loaded.values()), "adapter_evictions": self.residency.evictions}

    async def adapter_residency(self) -> tuple[str, dict[str, int]]:
        """(this replica, key -> bytes of every adapter version loaded on it now)."""
        from rollout_farm.services.replica.weight_verbs import replica_id

        return replica_id(), {k: b for k, (b, _) in self.engine.resident_adapters().items()}

    async def stage_adapter(
        self, key: str, config_json: str, body: bytes, probe_json: str | None = None
    ) -> tuple[str, int] | Invalid | Conflict:
        """Phase one: check the adapter against the served model and hold it; (its digest as this replica computes
        it, the base version it was computed on). With a probe (probe.py), the staged adapter must compute the
        pusher's logprobs. An adapter that does not fit, or fails its probe, is Invalid (422), returned."""
        try:
            return await asyncio.to_thread(self._stage_adapter, key, config_json, body, probe_json)
        except (Invalid, Conflict, NotSupported) as e:
            return e

    def _stage_adapter(self, key: str, config_json: str, body: bytes, probe_json: str | None = None) -> tuple[str, int]:
        if not self.engine.serves_adapters:
            raise NotSupported(f"the {type(self.engine).__name__} engine serves no adapters: use FARM_ENGINE=torch")
        try:
            config = read_config(config_json)
            tensors = {n: t.clone() for n, t in read_adapter(body).items()}
            hash_name, sums = adapter_checksums(tensors)
            self.engine.stage_adapter(key, config, tensors)
            self._sized(key, tensors)
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
            except EngineVerbMissing as e:  # SGLang: a 501, as for a base push's probe
                self.engine.discard_adapter(key)
                raise NotSupported(str(e)) from None
        version, base = self.engine.served_base()
        digest = adapter_digest(base or "", config.canonical(), hash_name, sums)
        self.adapter_digests[key] = (digest, base)
        return digest, version

    def _sized(self, key: str, tensors: dict) -> None:
        """Note the bytes staged `key` will hold once loaded; Invalid (after discarding it) when it can never fit
        within FARM_ADAPTER_BYTES_PER_REPLICA."""
        sized = getattr(self.engine, "staged_adapter_bytes", None)
        need = sized(key) if sized else sum(t.numel() * t.element_size() for t in tensors.values())
        if self.residency.too_large(need):
            self.engine.discard_adapter(key)
            budget = self.residency.budget
            raise Invalid(
                [{"field": "adapter_model", "message": f"{need} bytes loaded, more than {SETTING}={budget}"}],
                f"the adapter needs {need} bytes on a replica, more than {SETTING}={budget}: push a smaller adapter "
                f"(a lower r, fewer target_modules) or raise {SETTING}",
            )
        self.residency.sizes[key] = need

    def _make_room(self, key: str) -> bool:
        """Unload the least recently used versions no call pins until staged `key` fits within the byte budget;
        False (nothing more unloaded) when the versions in use leave no room. On the event loop: a request pins its
        version right after ensure_adapter returns, with no await between, so no version is unloaded under it."""
        res = self.residency
        need = res.sizes.get(key, 0)
        for _ in range(3):  # a victim pinned meanwhile (a call on another thread) is passed over on the next round
            loaded = self.engine.resident_adapters(include_retiring=True)
            loaded = {k: v for k, v in loaded.items() if not k.startswith("probe:")}  # a push's probe, for a moment
            victims = res.victims(loaded, key, need)
            if victims is None:
                return False
            if not victims:
                return True
            for victim in victims:
                if self._evict(victim):
                    res.evictions += 1
                    res.forget(victim)
                    self.adapter_digests.pop(victim, None)
                    log.info("adapter_unloaded_lru", extra={"adapter": victim, "bytes": loaded[victim][0]})
        return False

    def _evict(self, key: str) -> bool:
        """Unload `key` unless a call pins it; True when it is gone."""
        evict = getattr(self.engine, "evict_adapter", None)
        if evict is not None:
            return evict(key)
        if self.engine.resident_adapters().get(key, (0, 1))[1]:
            return False
        self.engine.retire_adapter(key)
        return True

    def _load(self, key: str) -> bool:
        """Staged `key` loaded (made resident), once there is room for it; False (discarded) when there is none."""
        if key in self.engine.resident_adapters():
            return True
        if not self._make_room(key):
            self.engine.discard_adapter(key)
            self.adapter_digests.pop(key, None)
            return False
        self.engine.commit_adapter(key)
        self.residency.used(key)
        return True

    async def commit_adapter(self, key: str, retire: list[str] | tuple = ()) -> None:
        """Phase two: `key` loaded; when the versions in use leave no room, it is not loaded now but when a request
        names it (its bytes are in Redis while it is resident). The `retire` keys (versions the push moved out
        of the resident window) are retired, in the same call, first: their bytes make room for it."""
        for old in retire:
            await self.retire_adapter(old)
        if not self._load(key):
            log.info("adapter_deferred", extra={"adapter": key, "budget": self.residency.budget})

    async def discard_adapter(self, key: str) -> None:
        self.engine.discard_adapter(key)
        if key not in self.engine.resident_adapters():
            self.adapter_digests.pop(key, None)

    async def retire_adapter(self, key: str) -> None:
        """Unload now, or when the last call using it ends."""
        self.engine.retire_adapter(key)
        self.adapter_digests.pop(key, None)
        self.residency.forget(key)

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
            self.residency.used(key)
            return key, held
        async with self.adapter_lock:
            if (held := self._held(key, expected_digest)) is not None:
                self.residency.used(key)
                return key, held
            name = f"{self.adapter_prefix}:adapter:{ref.name}"
            raw, stored = await asyncio.to_thread(
                lambda: (
                    self.adapter_bodies.hget(name, f"v{ref.version}"),
                    self.adapter_bodies.hgetall(f"{name}:v{ref.version}:bytes"),
                )
            )
            if raw is None or not stored:
                raise adapter_gone(ref)
            record = P.AdapterVersion.model_validate_json(raw)
            body, config_json = stored[b"body"], stored[b"config"].decode()
            if key in self.engine.resident_adapters(include_retiring=True):  # still used by a call: not replaced
                raise adapter_gone(ref)
            try:
                got, _ = await asyncio.to_thread(self._stage_adapter, key, config_json, body)
            except Invalid as e:  # accepted at its push: only FARM_ADAPTER_BYTES_PER_REPLICA, lowered since, refuses
                raise Unavailable(f"adapter {key} cannot be loaded on this replica: {e.message}", e.detail) from None
            if got != record.digest or got != expected_digest:
                self.engine.discard_adapter(key)
                self.adapter_digests.pop(key, None)
                raise Conflict(
                    f"adapter {key} was pushed with digest {record.digest}, but on this replica's base weights it is "
                    f"{got}: the base changed since the push; push the adapter again",
                    [{"field": "adapter.version", "message": "its digest does not match the base served now"}],
                )
            if not self._load(key):
                raise no_room(key, self.residency.budget)
            log.info("adapter_loaded", extra={"adapter": key, "digest": got})
            return key, got

    async def _scored(self, sequences, top_k: int, adapter: tuple[P.AdapterRef, str] | None):
        """EngineServer's engine.score on the engine's thread, under `adapter` when given (pinned here, on the loop:
        no byte budget unloads it before the thread pins it); a refusal is returned (an expected answer: Serve logs no
        traceback), a version retired meanwhile as a 409."""
        try:
            key = (await self.ensure_adapter(*adapter))[0] if adapter else None
            with self.engine.pinned(key):
                keyed = {"adapter": key} if key else {}
                return await self._on_engine_thread(functools.partial(self.engine.score, sequences, top_k, **keyed))
        except (Conflict, NotSupported, Overloaded, Unavailable) as e:
            return e
        except AdapterNotResident:
            return adapter_gone(adapter[0])
