"""The policy's weights to the service, pushed as the next version and checked to be served.

The push streams the canonical state dict straight from the parameters' memory
(rollout_farm/services/weights/pusher.py): no safetensors copy is made, and every replica verifies each tensor's
checksum. The mode is the config key trainer.weight_sync:
  full      (default) every tensor, every step: the fastest on one machine (docs: bench/weight_sync.py)
  bucketed  only the tensors that changed since the last push
  delta     changed tensors as compressed XOR against the last push: the fewest bytes, for a slow link
bucketed and delta fall back to a full push by themselves when a replica is not on the version they diff against.
"""

from __future__ import annotations

import json
import os
import time

import torch

from rollout_farm.services import protocol as P
from rollout_farm.services.client import FarmClient, FarmError
from rollout_farm.services.weights.pusher import WeightPusher, base_refused
from rollout_farm.services.weights.state_dict import canonical_state_dict

STATS_ENV = "FARM_WEIGHT_SYNC_STATS"  # a file: one JSON line per push (seconds, bytes, mode), for bench/weight_sync.py


def push_weights(pusher: WeightPusher, model: torch.nn.Module, in_flight: P.InFlightPolicy = "finish") -> int:
    """Send the model as the service's next version, with the in-flight policy `in_flight`; returns the version the
    service now serves (that one). The push answers once every replica serves it. The next version is one above the
    last this pusher pushed (asked of the service the first time, and again if another pusher got there first: a 409
    that is not about a base). Keep one pusher per run: bucketed and delta pushes diff against its last push."""
    state, client, start = canonical_state_dict(model), pusher.client, time.perf_counter()
    version = (pusher.version if pusher.version is not None else newest(client)) + 1
    try:
        pushed = pusher.push(state, version, in_flight)
    except FarmError as e:
        if e.status != 409 or base_refused(e):
            raise
        pushed = pusher.push(state, newest(client) + 1, in_flight)  # above every replica's, as the service requires
    if path := os.environ.get(STATS_ENV):
        with open(path, "a") as f:
            f.write(
                json.dumps({"version": pushed.version, "seconds": time.perf_counter() - start, **pusher.last}) + "\n"
            )
    return pushed.version


def newest(client: FarmClient) -> int:
    """The newest version a replica serves (a replica that is catching up may still serve an older one)."""
    v = client.weights_version()
    return max([v.version, *v.replicas.values()])
