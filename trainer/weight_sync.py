"""The policy's weights to the service: safetensors bytes, pushed as the next version, checked to be served."""

from __future__ import annotations

import torch
from safetensors.torch import save

from services.client import FarmClient
from services.engine.state_dict import cpu_state_dict


def push_weights(client: FarmClient, policy: torch.nn.Module) -> int:
    """Send the policy as the service's next version; returns the version the service now serves (that one)."""
    data = save(cpu_state_dict(policy))
    pushed = client.push_weights(data, newest(client) + 1)  # above every replica's, as the service requires
    served = newest(client)
    if served != pushed.version:
        raise RuntimeError(f"pushed version {pushed.version} but the service serves {served}")
    return served


def newest(client: FarmClient) -> int:
    """The newest version a replica serves (a replica that is catching up may still serve an older one)."""
    v = client.weights_version()
    return max([v.version, *v.replicas.values()])
