"""A model's tensors as the weight transports see them: names, shapes and safetensors dtypes."""

from __future__ import annotations

import torch

ST_DTYPES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.bool: "BOOL",
}

Spec = dict[str, tuple[list[int], str]]  # name -> (shape, safetensors dtype)


def canonical_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """model.state_dict() without tied duplicates (the names save_pretrained writes)."""
    seen, out = set(), {}
    for name, t in model.state_dict().items():
        key = (t.data_ptr(), tuple(t.shape))
        if key not in seen:
            seen.add(key)
            out[name] = t
    return out


def spec_of(tensors: dict[str, torch.Tensor]) -> Spec:
    """name -> (shape, safetensors dtype) of a state dict (or of parameters on the meta device)."""
    return {n: (list(t.shape), ST_DTYPES.get(t.dtype, str(t.dtype))) for n, t in tensors.items()}


def cpu_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The canonical tensors, detached, contiguous and on the CPU: what safetensors writes."""
    return {k: v.detach().cpu().contiguous() for k, v in canonical_state_dict(model).items()}
