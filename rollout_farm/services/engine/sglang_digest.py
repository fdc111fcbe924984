"""The base digest of an SGLang engine (rollout_farm/services/adapters/digest.py): SGLang holds the only copy of the
weights it serves, on its GPUs, so the digest is computed from what it was told to load: the model folder's
safetensors at the start, and each base push's tensors or folder. Each tensor is cast to the dtype SGLang serves
(FARM_DTYPE), as SGLang casts it when it loads, and only the model's own parameters count (the names of
`weight_spec`: a tied lm_head that a folder also stores is the embedding's, not a tensor of its own).

The bytes are hashed; that SGLang serves them is what a push's probe proves (docs/tenants.md). A push over NCCL
passes no bytes through the replica, so after one the digest is unknown (None): an adapter's digest then covers the
adapter alone, which a trainer's read-your-writes check refuses, until a push through the replica (upload or path)
names the weights again.

A folder is read one tensor at a time (safetensors' safe_open), so hashing a large model holds one tensor in memory.
"""

from __future__ import annotations

from pathlib import Path

import torch

from rollout_farm.services.adapters.digest import base_digest, tensor_checksums


def tensors_digest(tensors: dict[str, torch.Tensor], names: set[str], dtype: torch.dtype) -> str | None:
    """The base digest of `tensors` (the whole served state) cast to `dtype`; None when one of `names` is missing."""
    if not names <= tensors.keys():
        return None
    sums: dict[str, str] = {}
    hash_name = None
    for name in sorted(names):
        hash_name, one = tensor_checksums({name: cast(tensors[name], dtype)}, hash_name)
        sums.update(one)
    return base_digest(hash_name, sums) if hash_name else None


def folder_digest(path: str | Path, names: set[str], dtype: torch.dtype) -> str | None:
    """The base digest of a model folder's safetensors files cast to `dtype`; None when the folder holds none, or
    lacks one of `names` (a .bin checkpoint, a sharded one with a missing file)."""
    from safetensors import safe_open

    sums: dict[str, str] = {}
    hash_name = None
    for f in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for name in sorted(names & set(st.keys())):
                hash_name, one = tensor_checksums({name: cast(st.get_tensor(name), dtype)}, hash_name)
                sums.update(one)
    return base_digest(hash_name, sums) if hash_name and sums.keys() == names else None


def cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.to(dtype) if t.is_floating_point() else t
