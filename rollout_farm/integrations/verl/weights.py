"""push_state_dict: an actor's tensors to the farm as a new weight version, over one of the farm's transports."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from safetensors.torch import save

from rollout_farm.services import protocol as P
from rollout_farm.services.client import FarmClient
from rollout_farm.services.weights.path_pusher import PathPusher


def push_state_dict(
    client: FarmClient,
    weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    version: int | None = None,
    policy: P.InFlightPolicy = "finish",
    shared_dir: str | Path | None = None,
) -> int:
    """Send `weights` (a state_dict, or the (name, tensor) pairs verl's BaseRollout.update_weights receives, HF
    names) as `version` (default: the served one + 1; verl's global_steps keeps the two numbers one). Returns the
    version every replica now serves. Without shared_dir the safetensors bytes are uploaded (POST /v1/weights,
    checksummed); with it they are written to shared_dir/v<version>/ and loaded from there (POST /v1/weights/path:
    a folder every replica can read; the newest 3 are kept: rollout_farm/services/weights/path_pusher.py). The farm
    checks names, shapes and dtypes against its model and refuses a mismatch whole (FarmError 422), serving the
    old version."""
    pairs = list(weights.items() if isinstance(weights, Mapping) else weights)
    tensors = {name: t.detach().cpu().contiguous() for name, t in pairs}
    if len(tensors) != len(pairs):
        raise ValueError("weights name a tensor twice: give each name once")
    if version is None:
        version = client.weights_version().version + 1
    if shared_dir is None:
        pushed = client.push_weights(save(tensors), version, policy)
    else:
        pushed = PathPusher(client, shared_dir).push(tensors, version, policy)
    return pushed.version
