"""The policy's weights to the service: safetensors bytes, pushed as the next version, checked to be served."""

from __future__ import annotations

import torch
from safetensors.torch import save

from services.client import FarmClient
from services.engine.state_dict import cpu_state_dict


def push_weights(client: FarmClient, policy: torch.nn.Module) -> int:
    """Send the policy as the service's next version; returns the version the service now serves (that one)."""
    data = save(cpu_state_dict(policy))
    pushed = client.push_weights(data, client.weights_version().version + 1)
    served = client.weights_version().version
    if served != pushed.version:
        raise RuntimeError(f"pushed version {pushed.version} but the service serves {served}")
    return served
