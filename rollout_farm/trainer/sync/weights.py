"""The policy's weights to the service, pushed as the next version and checked to be served.

The push streams the canonical state dict straight from the parameters' memory
(rollout_farm/services/weights/pusher.py): no safetensors copy is made, and every replica verifies each tensor's
checksum. The mode is the config key trainer.weight_sync:
  full      (default) every tensor, every step: the fastest on one machine (docs: bench/weight_sync.py)
  bucketed  only the tensors that changed since the last push
  delta     changed tensors as compressed XOR against the last push: the fewest bytes, for a slow link
bucketed and delta fall back to a full push by themselves when a replica is not on the version they diff against.
With trainer.push_dir the pusher is a PathPusher (rollout_farm/services/weights/path_pusher.py) instead: each step
is written once to that folder, which the farm reads too, and pushed by path (no upload).

Each push carries a probe (rollout_farm/trainer/sync/probe.py, trainer.push_probe_sequences; 0: none): every replica
scores it on the staged weights, and a farm that refuses the push for it stops the run (ProbeRefused).
"""

from __future__ import annotations

import json
import os
import time

import torch

from rollout_farm.services import protocol as P
from rollout_farm.services.client import FarmClient, FarmError
from rollout_farm.services.weights.path_pusher import PathPusher
from rollout_farm.services.weights.pusher import WeightPusher, base_refused
from rollout_farm.services.weights.state_dict import canonical_state_dict
from rollout_farm.trainer.sync.probe import PushProbe, stop_if_probe_refused

STATS_ENV = "FARM_WEIGHT_SYNC_STATS"  # a file: one JSON line per push (seconds, bytes, mode), for bench/weight_sync.py


def push_weights(
    pusher: WeightPusher | PathPusher,
    model: torch.nn.Module,
    in_flight: P.InFlightPolicy = "finish",
    probe: PushProbe | None = None,
) -> int:
    """Send the model as the service's next version, with the in-flight policy `in_flight` and the model's probe
    (`probe`; None: none); returns the version the service now serves (that one). The push answers once every replica
    serves it. The next version is one above the last this pusher pushed (asked of the service the first time, and
    again if another pusher got there first: a 409 that is not about a base). Keep one pusher per run: bucketed and
    delta pushes diff against its last push. ProbeRefused when the farm refuses it for its probe."""
    state, client, start = canonical_state_dict(model), pusher.client, time.perf_counter()
    version = (pusher.version if pusher.version is not None else newest(client)) + 1
    scored, taken = (probe.of(model) if probe is not None else None), False
    while True:  # again without the probe after a 501 for it, and once above every replica's after a 409
        try:
            pushed = pusher.push(state, version, in_flight, scored)
            break
        except FarmError as e:
            if scored is not None and probe.cannot_score(e):
                scored = None
            elif e.status == 409 and not base_refused(e) and not taken:
                version, taken = newest(client) + 1, True
            else:
                stop_if_probe_refused(e, f"the weights pushed as version {version}")
                raise
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
