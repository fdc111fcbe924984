"""Batched LoRA: rows of one forward pass use different adapters (or none) and share the base model's matmuls.

Each adapted linear layer computes its base output once for the whole batch, then adds each row's low-rank delta,
scaling * (x_rows @ A^T) @ B^T, gathered per segment of rows that use the same adapter: the segmented gather of
Punica's SGMV and S-LoRA, written in PyTorch (one pair of small matmuls per adapter in the batch, none for the
rows on the base model). A forward hook on the layer adds the deltas, so the HF model runs unchanged; `rows` says,
for the forward passes inside it, which adapter each batch row uses.

Adapters are resident under a key (`name@vN`, never reused for other bytes): `load` puts their tensors on the
model's device and dtype, `unload` drops them. A key is used only while resident; the engine pins keys for its calls
(engine.py), so nothing unloads an adapter a running row uses.
"""

from __future__ import annotations

import contextlib
import threading
import weakref

import torch
from torch import nn

_LAYERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its LoraLayers


def adapter_rows(model: nn.Module, keys: list[str | None]):
    """The context of a forward pass of `model` whose row i uses adapter keys[i] (None: the base model)."""
    layers = _LAYERS.get(model)
    if layers is None or not any(keys):
        return contextlib.nullcontext()
    return layers.rows(keys)


class Adapter:
    """One resident adapter: per module path, its (A, B) on the device, and the scaling."""

    def __init__(self, pairs: dict[str, tuple[torch.Tensor, torch.Tensor]], scaling: float):
        self.pairs, self.scaling = pairs, scaling
        self.bytes = sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in pairs.values())


class LoraLayers:
    """The model's linear layers that adapters may adapt, the resident adapters, their pins (the calls using each)
    and the row assignment of the forward passes running now (`rows`, per thread)."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.linears = {path: m for path, m in model.named_modules() if isinstance(m, nn.Linear)}
        self.adapters: dict[str, Adapter] = {}
        self._hooked: set[str] = set()
        self._local = threading.local()
        self._pins: dict[str, int] = {}
        self._retiring: set[str] = set()  # unload once unpinned
        self._lock = threading.Lock()
        _LAYERS[model] = self

    # residency -------------------------------------------------------------------------------------
    def pin(self, key: str) -> None:
        """A call uses `key` from now until unpin: it stays resident. KeyError when it is not (or is retiring)."""
        with self._lock:
            if key not in self.adapters or key in self._retiring:
                raise KeyError(key)
            self._pins[key] = self._pins.get(key, 0) + 1

    def unpin(self, key: str) -> None:
        with self._lock:
            self._pins[key] -= 1
            if not self._pins[key]:
                del self._pins[key]
                if key in self._retiring:
                    self._retiring.discard(key)
                    self.adapters.pop(key, None)

    def retire(self, key: str) -> bool:
        """Unload `key` now, or when its last call ends; True when it is gone already."""
        with self._lock:
            if self._pins.get(key):
                self._retiring.add(key)
                return False
            self.adapters.pop(key, None)
            return True

    def resident(self, include_retiring: bool = False) -> dict[str, tuple[int, int]]:
        """key -> (bytes on the device, calls pinning it) of every usable adapter (include_retiring: and of those
        retired while a call still uses them)."""
        with self._lock:
            return {
                k: (a.bytes, self._pins.get(k, 0))
                for k, a in self.adapters.items()
                if include_retiring or k not in self._retiring
            }

    def shapes(self) -> dict[str, tuple[int, int]]:
        """module path -> (in_features, out_features) of every linear layer."""
        return {p: (m.in_features, m.out_features) for p, m in self.linears.items()}

    def load(self, key: str, pairs: dict[str, tuple[torch.Tensor, torch.Tensor]], scaling: float) -> None:
        """Make adapter `key` resident: pairs is module path -> (lora_A, lora_B), checked against shapes()."""
        if key in self._retiring:  # a call still uses the copy being retired: never two under one key
            raise KeyError(f"adapter {key} is being retired: it cannot be loaded again until its calls end")
        weight = next(self.model.parameters())
        on = {p: (a.to(weight.device, weight.dtype), b.to(weight.device, weight.dtype)) for p, (a, b) in pairs.items()}
        for path in on:
            if path not in self._hooked:
                self.linears[path].register_forward_hook(self._hook(path))
                self._hooked.add(path)
        self.adapters[key] = Adapter(on, scaling)

    @contextlib.contextmanager
    def rows(self, keys: list[str | None]):
        """Within: forward passes whose row i uses adapter keys[i] (None: the base model). KeyError for a key that is
        not resident."""
        segments = _segments(keys, self.adapters)
        before = getattr(self._local, "segments", None)
        self._local.segments = segments
        try:
            yield
        finally:
            self._local.segments = before

    def _hook(self, path: str):
        def add_deltas(module: nn.Linear, inputs: tuple, output: torch.Tensor):
            segments = getattr(self._local, "segments", None)
            if not segments:
                return None
            x = inputs[0]
            for adapter, rows in segments:
                pair = adapter.pairs.get(path)
                if pair is None:
                    continue
                a, b = pair
                if rows is None:  # every row on this adapter
                    output = output + adapter.scaling * ((x @ a.T) @ b.T)
                else:
                    delta = adapter.scaling * ((x[rows] @ a.T) @ b.T)
                    output = output.index_add(0, rows, delta)
            return output

        return add_deltas


def _segments(keys: list[str | None], adapters: dict[str, Adapter]) -> list[tuple[Adapter, torch.Tensor | None]]:
    """Per distinct adapter among `keys`, its rows (None when it has them all); the base rows need none."""
    distinct = {k for k in keys if k is not None}
    if not distinct:
        return []
    missing = sorted(k for k in distinct if k not in adapters)
    if missing:
        raise KeyError(f"adapters {missing} are not resident")
    if len(distinct) == 1 and None not in keys:
        return [(adapters[next(iter(distinct))], None)]
    device = next(iter(adapters[next(iter(distinct))].pairs.values()))[0].device
    return [
        (adapters[k], torch.tensor([i for i, x in enumerate(keys) if x == k], dtype=torch.long, device=device))
        for k in sorted(distinct)
    ]


def merged(model: nn.Module, pairs: dict[str, tuple[torch.Tensor, torch.Tensor]], scaling: float) -> None:
    """Fold an adapter into the model's weights in place (W += scaling * B @ A): the reference batched LoRA must
    equal (tests, bench/lora_batched.py)."""
    modules = dict(model.named_modules())
    with torch.no_grad():
        for path, (a, b) in pairs.items():
            w = modules[path].weight
            w += scaling * (b.to(w.dtype) @ a.to(w.dtype))
