"""The policy digest: what every sample carries to prove which weights drew it, and what a client computes from what
it pushed (read-your-writes, without trusting version numbers).

    base digest     "<hash>:" + hash of the sorted "name=checksum" lines of every base tensor
    adapter digest  "<hash>:" + hash of the base digest, the adapter's config (r, alpha, rsLoRA: peft_format.py) and
                    the sorted "name=checksum" lines of its tensors

The checksums are the per-tensor ones a weight push's manifest carries (rollout_farm/services/weights/manifest.py:
xxh3_128 by default), so a pusher has them already; `tensor_checksums` computes them from a state dict. Light on
purpose: hashlib only, so the client and the trainer import it without the service.
"""

from __future__ import annotations

import hashlib


def _lines(checksums: dict[str, str]) -> bytes:
    return "".join(f"{name}={checksums[name]}\n" for name in sorted(checksums)).encode()


def base_digest(hash_name: str, checksums: dict[str, str]) -> str:
    """The base model's digest from its tensors' checksums (name -> hex, computed with `hash_name`)."""
    return f"{hash_name}:" + hashlib.sha256(b"farm-base-v1\n" + _lines(checksums)).hexdigest()[:32]


def adapter_digest(base: str, config_canonical: str, hash_name: str, checksums: dict[str, str]) -> str:
    """An adapter's policy digest: on top of the base digest `base`, its config (LoraConfig.canonical()) and its
    tensors' checksums (name -> hex, computed with `hash_name`)."""
    head = f"farm-adapter-v1\n{base}\n{config_canonical}\n{hash_name}\n".encode()
    return f"{hash_name}:" + hashlib.sha256(head + _lines(checksums)).hexdigest()[:32]


def tensor_checksums(tensors, hash_name: str | None = None) -> tuple[str, dict[str, str]]:
    """(hash name, name -> checksum) of a state dict of torch tensors, as a push's manifest computes them."""
    from rollout_farm.services.weights.manifest import manifest_of

    m = manifest_of(tensors, hash_name)
    return m.hash, {n: h for n, (h, _) in m.tensors.items()}
