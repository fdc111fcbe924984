"""LoRA training's side of the service: the actor's adapter pushed as `<name>@v<N>`, and read-your-writes on every
sample the trainer trains on (docs/tenants.md, docs/trainer.md "Training a LoRA adapter").

The push. Only the adapter goes up (peft's adapter_config.json and adapter_model.safetensors): uploaded, or written
to `trainer.adapter_push_dir` and pushed by path. The farm serves its own copy of the base: the same model folder.
Version N holds the weights after step N - 1 (v1 is the initial adapter, whose B is zero: the base), never below the
last push + 1. A 409 that names the version (used before for other bytes, e.g. by an earlier run under this name, or
below the newest) pushes above the adapter's newest version instead.

Read-your-writes. For each version it pushed, the trainer computes the policy digest the farm must stamp on the
samples drawn from it, from what it pushed and never from a version number
(rollout_farm/services/adapters/digest.py): the base digest from the base model's own tensors (hashed once, at
start), and the adapter's config and tensors. The push answer's digest must be the same; otherwise the farm serves
other base weights, and the run stops with both digests. (A farm serving the same base in bfloat16 or float16 gives
the digest of those tensors cast: it is accepted as such, and logged.)

The probe. Each push carries a probe (rollout_farm/trainer/sync/probe.py): logprobs of a few sequences under the
actor with this adapter, in float32, which every replica scores on the staged adapter before the commit. A farm that
refuses the push for it stops the run (ProbeRefused).

Every sample must then carry `policy` {adapter: this name, adapter_version: a version this trainer pushed, digest:
that version's}. A sample with another policy stops the run (PolicyMismatch) rather than being dropped: a farm
that serves other bytes under the run's name, or another policy, is broken, and dropping its samples would train on
fewer and hide it. The one exception: a queue group drawn from a version this process never pushed (left in the
queue by an earlier process of the run) cannot be judged, and is refused like a stale group.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import load_file

from rollout_farm.services import protocol as P
from rollout_farm.services.adapters.digest import adapter_digest, base_digest, tensor_checksums
from rollout_farm.services.adapters.peft_format import read_folder
from rollout_farm.services.client import FarmClient, FarmError
from rollout_farm.trainer import lora
from rollout_farm.trainer.sync.probe import PushProbe, stop_if_probe_refused

log = logging.getLogger("farm.trainer")

SERVED_DTYPES = (None, torch.bfloat16, torch.float16)  # the base as the trainer holds it, then cast as a farm may


class PolicyMismatch(RuntimeError):
    """The farm stamped a sample, or answered a push, with another policy than the one the trainer pushed."""


class AdapterSync:
    """One run's adapter at the farm: its pushes, and the digest of every version pushed."""

    def __init__(
        self,
        client: FarmClient,
        name: str,
        base: dict[str, torch.Tensor],
        push_dir: str | None = None,
        probe: PushProbe | None = None,
    ):
        """`base`: the base model's tensors under the farm's names (lora.base_tensors); hashed here, once. `probe`:
        each push's probe sequences (None: pushes carry none)."""
        self.client, self.name, self.base, self.probe = client, name, base, probe
        self.push_dir = Path(push_dir) / name if push_dir else None
        self.hash, sums = tensor_checksums(base)
        self._bases = {(self.hash, None): base_digest(self.hash, sums)}  # (hash, served dtype) -> base digest
        self.served: torch.dtype | None = None  # the dtype the farm serves the base in, when not the trainer's
        self.digests: dict[int, str] = {}  # version -> its policy digest, for every version this trainer pushed
        self.last = 0

    @property
    def base_digest(self) -> str:
        return self.base_of(self.hash, self.served)

    def base_of(self, hash_name: str, dtype: torch.dtype | None) -> str:
        """The base digest with `hash_name`, of the base's floating tensors cast to `dtype` (None: as held)."""
        if (hash_name, dtype) not in self._bases:
            cast = {n: t.to(dtype) if dtype and t.is_floating_point() else t for n, t in self.base.items()}
            self._bases[hash_name, dtype] = base_digest(*tensor_checksums(cast, hash_name))
        return self._bases[hash_name, dtype]

    # the push -------------------------------------------------------------------------------------------------
    def push(self, model: torch.nn.Module, version: int) -> int:
        """Push the model's adapter as `version`, or above the last push; returns the version the farm serves now.
        PolicyMismatch when the farm's digest of it is not the one computed here; ProbeRefused when the farm refuses
        it for its probe."""
        version = max(version, self.last + 1)
        scored = self.probe.of(model) if self.probe is not None else None
        with self._folder(version) as folder:
            lora.save_adapter(model, folder)
            try:
                try:
                    answer = self._send(folder, version, scored)
                except FarmError as e:
                    if scored is None or not self.probe.cannot_score(e):
                        raise
                    answer = self._send(folder, version, None)
            except FarmError as e:
                stop_if_probe_refused(e, f"adapter {self.name}@v{version}")
                raise
            want = self.expected(folder, answer.digest)
        self.digests[answer.version], self.last = want, answer.version
        log.info("adapter_pushed", extra={"adapter": self.name, "version": answer.version, "digest": want})
        return answer.version

    def _send(self, folder: Path, version: int, probe: dict | None = None) -> P.AdapterPushResponse:
        try:
            return self._push(folder, version, probe)
        except FarmError as e:
            if e.status == 404:
                raise RuntimeError(
                    f"adapter {self.name!r} belongs to another tenant: choose another name (farm train --adapter NAME)"
                ) from e
            if not version_refused(e):
                raise
        newest = max((v.version for v in self.client.adapter(self.name).versions), default=0)
        log.warning("adapter_version_taken", extra={"adapter": self.name, "version": version, "newest": newest})
        return self._push(folder, newest + 1, probe)

    def _push(self, folder: Path, version: int, probe: dict | None) -> P.AdapterPushResponse:
        if self.push_dir is not None:
            return self.client.push_adapter_path(self.name, str(folder.resolve()), version, probe)
        return self.client.push_adapter(self.name, str(folder), version, probe)

    @contextlib.contextmanager
    def _folder(self, version: int) -> Iterator[Path]:
        """Where a version's files are written: a temporary folder for an upload, else <push dir>/<name>/v<N>/ (kept:
        the replicas read it)."""
        if self.push_dir is None:
            with tempfile.TemporaryDirectory(prefix=f"{self.name}-v{version}-") as tmp:
                yield Path(tmp)
            return
        folder = self.push_dir / f"v{version}"
        shutil.rmtree(folder, ignore_errors=True)  # an earlier run's: the farm keeps what it served in Redis
        folder.mkdir(parents=True)
        yield folder

    def expected(self, folder: Path, answered: str) -> str:
        """The policy digest of the adapter in `folder` on the base, computed with the hash the answer `answered`
        names; PolicyMismatch, naming both, unless it is `answered`."""
        config, tensors_file = read_folder(folder)
        hash_name = answered.partition(":")[0] or self.hash
        try:
            _, sums = tensor_checksums(load_file(tensors_file), hash_name)
        except ValueError as e:  # a hash this trainer cannot compute (rollout_farm/services/weights/manifest.py)
            raise PolicyMismatch(
                f"{self.name}: the farm's digest {answered!r} names a hash the trainer cannot compute: {e}"
            ) from None
        for dtype in dict.fromkeys((self.served, *SERVED_DTYPES)):
            want = adapter_digest(self.base_of(hash_name, dtype), config.canonical(), hash_name, sums)
            if want == answered:
                if dtype != self.served:
                    log.info("farm_base_dtype", extra={"adapter": self.name, "dtype": str(dtype or "as loaded")})
                    self.served = dtype
                return want
        want = adapter_digest(self.base_of(hash_name, None), config.canonical(), hash_name, sums)
        raise PolicyMismatch(
            f"{self.name}: the farm's digest of the adapter just pushed is {answered}, the trainer computed {want} "
            "from that adapter on the base model it loaded (actor_rollout_ref.model.path): the farm serves other base "
            "weights. Serve the same model folder (FARM_MODEL), and push no base weights while LoRA training runs"
        )

    # the samples ----------------------------------------------------------------------------------------------
    def verified(self, group: P.Group) -> P.Group | None:
        """The group with each sample's weight_version its adapter version (what the staleness counts in LoRA
        training; an adapter version never changes within a sample), once every sample's policy is checked: this
        run's adapter, at a version this trainer pushed, with that version's digest. None when a sample comes from a
        version this trainer never pushed; PolicyMismatch for any other policy."""
        samples = []
        for s in group.samples:
            p = s.policy
            if p is None or p.adapter != self.name:
                raise PolicyMismatch(
                    f"a sample came from {describe(p)}, not from adapter {self.name!r}: the farm did not sample from "
                    "the adapter this run pushed; nothing of this batch is trained on"
                )
            want = self.digests.get(p.adapter_version)
            if want is None:
                return None
            if p.digest != want:
                raise PolicyMismatch(
                    f"a sample of {self.name}@v{p.adapter_version} carries digest {p.digest}, but the adapter this "
                    f"trainer pushed as that version has digest {want}: the farm served other bytes under this "
                    "version; nothing of this batch is trained on"
                )
            samples.append(s.model_copy(update={"weight_version": p.adapter_version, "token_weight_versions": None}))
        return group.model_copy(update={"samples": samples})

    def verified_all(self, groups: list[P.Group], asked: int) -> list[P.Group]:
        """verified() of each group of a request for version `asked`; PolicyMismatch for a version never pushed."""
        out = []
        for g in groups:
            checked = self.verified(g)
            if checked is None:
                versions = sorted({s.policy.adapter_version for s in g.samples})
                raise PolicyMismatch(
                    f"asked for {self.name}@v{asked}, got samples of version(s) {versions}, which this trainer never "
                    f"pushed (it pushed {sorted(self.digests)})"
                )
            out.append(checked)
        return out

    def ref(self, version: int) -> P.AdapterRef:
        return P.AdapterRef(name=self.name, version=version)


def version_refused(e: FarmError) -> bool:
    """A 409 that names the version: used before for other bytes, or below the adapter's newest."""
    body = e.body if isinstance(e.body, dict) else {}
    return e.status == 409 and any(d.get("field") == "version" for d in body.get("detail") or [])


def describe(p: P.Policy | None) -> str:
    if p is None:
        return "an engine that stamps no policy"
    if p.adapter is None:
        return f"the base model (version {p.base_version})"
    return f"adapter {p.adapter}@v{p.adapter_version}"
