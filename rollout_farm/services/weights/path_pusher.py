"""The client's side of weight pushes by path: each version written once into a folder the farm reads too.

When the trainer and the farm share storage (one machine, compose's `weights` volume, the Helm chart's volume), the
weights need not travel over HTTP: the pusher writes the state dict once as <folder>/v<N>/model.safetensors and sends
POST /v1/weights/path, and every replica reads the folder itself. The farm's store records the folder, so a farm that
restarts loads the committed version from there; an upload reaches disk only when the farm writes its own copy
(FARM_UPLOADS_DIR). The folder must be one the farm reads at the same path, inside its FARM_WEIGHTS_DIR when set.

The folder keeps the newest KEEP versions (the committed one is the newest: a replica that starts later, or a farm
that restarts, loads it) and each push deletes the older v<N> folders: at most KEEP models' worth of disk. A version
the farm refused stays until a newer push passes it.
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file

from rollout_farm.services import protocol as P
from rollout_farm.services.client import FarmClient

KEEP = 3  # versions kept in the folder: the committed one and the two before it, for a replica still loading one


def write_version(folder: str | Path, version: int, tensors: Mapping[str, torch.Tensor]) -> Path:
    """`tensors` as <folder>/v<version>/model.safetensors, written afresh (an earlier run's folder of that name is
    replaced); returns the version's folder, resolved (the path the farm is sent)."""
    out = Path(folder) / f"v{version}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    save_file({n: t.detach().cpu().contiguous() for n, t in tensors.items()}, out / "model.safetensors")
    return out.resolve()


def prune(folder: str | Path, newest: int, keep: int = KEEP) -> None:
    """Delete the v<N> folders in `folder` older than the `keep` newest versions up to `newest`."""
    for d in Path(folder).glob("v*"):
        if d.name[1:].isdigit() and int(d.name[1:]) <= newest - keep and d.is_dir():
            shutil.rmtree(d, ignore_errors=True)


class PathPusher:
    """Pushes a state dict by path (WeightPusher's interface: push, version, last)."""

    def __init__(self, client: FarmClient, folder: str | Path, keep: int = KEEP):
        self.client, self.folder, self.keep = client, Path(folder), keep
        self.version: int | None = None  # the last version this pusher pushed
        self.last: dict = {}  # the last push: mode, bytes written (the folder's size)

    def push(
        self,
        tensors: Mapping[str, torch.Tensor],
        version: int,
        policy: P.InFlightPolicy = "finish",
        probe: dict | None = None,
    ) -> P.WeightsPushResponse:
        """Write `tensors` as `version` and load them from there on every replica, with `probe` if given; the
        answer comes once every replica serves it."""
        where = write_version(self.folder, version, tensors)
        r = self.client.push_weights_path(str(where), version, policy, probe=probe)
        self.version = r.version
        self.last = {"mode": "path", "bytes": r.bytes, "sent_tensors": r.sent_tensors, "fallback": False}
        prune(self.folder, r.version, self.keep)
        return r
