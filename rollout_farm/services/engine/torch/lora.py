"""Batched LoRA: rows of one forward pass use different adapters (or none) and share the base model's matmuls.

Each adapted linear layer computes its base output once for the whole batch, then adds each row's low-rank delta,
scaling * (x @ A^T) @ B^T. With one adapter for every row, that is two small matmuls. With several (or base rows
among them), each row's A and B are gathered from the batch's adapters stacked (rank padded with zeros, a zero slot
for the base rows and for layers an adapter leaves alone) and applied with two batched matmuls: Punica's BGMV
written in PyTorch, a constant number of operations however many adapters share the batch. A forward hook on the
layer adds the deltas, so the HF model runs unchanged; `rows` says, for the forward passes inside it, which
adapter each batch row uses.

Adapters are resident under a key (`name@vN`, never reused for other bytes): `load` puts their tensors on the
model's device and dtype, `retire` drops them (once unpinned), `evict` drops them only if unpinned (a replica's byte
budget). A key is used only while resident; the engine pins keys for its calls (engine.py), so nothing unloads an
adapter a running row uses.
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
        self._stacks: dict[tuple, tuple] = {}  # (path, adapters) -> their A, B and scalings stacked (Mix.stacked)
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
                    self._stacks.clear()

    def retire(self, key: str) -> bool:
        """Unload `key` now, or when its last call ends; True when it is gone already."""
        with self._lock:
            if self._pins.get(key):
                self._retiring.add(key)
                return False
            self.adapters.pop(key, None)
            self._stacks.clear()
            return True

    def evict(self, key: str) -> bool:
        """Unload `key` now if no call pins it (a replica's byte budget: rollout_farm/services/adapters/residency.py);
        False, and nothing changes, when one does. Unlike retire, the key may be loaded again at once."""
        with self._lock:
            if self._pins.get(key) or key in self._retiring:
                return False
            self.adapters.pop(key, None)
            self._stacks.clear()
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
        self._stacks.clear()

    @contextlib.contextmanager
    def rows(self, keys: list[str | None]):
        """Within: forward passes whose row i uses adapter keys[i] (None: the base model). KeyError for a key that is
        not resident."""
        segments = _segments(keys, self.adapters, self._stacks)
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
            if isinstance(segments, Mix):
                return segments.add(path, x, output)
            for adapter, rows in segments:
                pair = adapter.pairs.get(path)
                if pair is None:
                    continue
                a, b = pair
                if rows is None:  # every row on this adapter
                    output.add_((x @ a.T) @ b.T, alpha=adapter.scaling)
                else:  # in place: a copy of the whole output per adapter would cost more than the delta
                    output.index_add_(0, rows, (x[rows] @ a.T) @ b.T, alpha=adapter.scaling)
            return output

        return add_deltas


class Mix:
    """A batch whose rows use several adapters (or some the base): each row's slot in the adapters' stacks."""

    def __init__(self, keys: list[str | None], adapters: dict[str, Adapter], stacks: dict[tuple, tuple]):
        self.names = tuple(sorted({k for k in keys if k is not None}))
        self.adapters = [adapters[k] for k in self.names]
        self.stacks = stacks
        device = next(iter(self.adapters[0].pairs.values()))[0].device
        slot = {k: i + 1 for i, k in enumerate(self.names)}  # 0: the base (a zero delta)
        self.idx = torch.tensor([slot.get(k, 0) if k is not None else 0 for k in keys], device=device)

    def stacked(self, path: str, like: torch.Tensor):
        """(A (n+1, r, in), B (n+1, out, r), scaling (n+1,)) of the batch's adapters at `path`, slot 0 and layers an
        adapter leaves alone zero, ranks padded with zeros; kept until an adapter loads or leaves."""
        key = (path, self.names)
        found = self.stacks.get(key)  # read once: another thread may clear the cache meanwhile
        if found is None:
            pairs = [a.pairs.get(path) for a in self.adapters]
            r = max(p[0].shape[0] for p in pairs if p is not None)
            n_in, n_out = next((p[0].shape[1], p[1].shape[0]) for p in pairs if p is not None)
            a_stack = like.new_zeros((len(pairs) + 1, r, n_in))
            b_stack = like.new_zeros((len(pairs) + 1, n_out, r))
            scale = like.new_zeros(len(pairs) + 1)
            for i, (pair, adapter) in enumerate(zip(pairs, self.adapters), start=1):
                if pair is not None:
                    a, b = pair
                    a_stack[i, : a.shape[0]], b_stack[i, :, : b.shape[1]], scale[i] = a, b, adapter.scaling
            found = self.stacks[key] = (a_stack, b_stack, scale)
        return found

    def add(self, path: str, x: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
        if all(path not in a.pairs for a in self.adapters):
            return output
        a_stack, b_stack, scale = self.stacked(path, output)
        a, b, s = a_stack[self.idx], b_stack[self.idx], scale[self.idx]  # each row's own
        flat = x.reshape(x.shape[0], -1, x.shape[-1])  # (B, T, in)
        delta = torch.bmm(torch.bmm(flat, a.transpose(1, 2)), b.transpose(1, 2)) * s[:, None, None]
        return output.add_(delta.reshape(output.shape))


def _segments(keys: list[str | None], adapters: dict[str, Adapter], stacks: dict[tuple, tuple]):
    """The rows' adapters: [] when every row is on the base, [(adapter, None)] when one adapter has them all, else
    a Mix."""
    distinct = {k for k in keys if k is not None}
    if not distinct:
        return []
    missing = sorted(k for k in distinct if k not in adapters)
    if missing:
        raise KeyError(f"adapters {missing} are not resident")
    if len(distinct) == 1 and None not in keys:
        return [(adapters[next(iter(distinct))], None)]
    return Mix(keys, adapters, stacks)


def merged(model: nn.Module, pairs: dict[str, tuple[torch.Tensor, torch.Tensor]], scaling: float) -> None:
    """Fold an adapter into the model's weights in place (W += scaling * B @ A): the reference batched LoRA must
    equal (tests, bench/lora_batched.py)."""
    modules = dict(model.named_modules())
    with torch.no_grad():
        for path, (a, b) in pairs.items():
            w = modules[path].weight
            w += scaling * (b.to(w.dtype) @ a.to(w.dtype))
