"""Which adapter versions one engine replica keeps loaded: at most FARM_ADAPTER_BYTES_PER_REPLICA bytes of them.

The registry's resident window (registry.py) says which versions a request may name; this says which of those a
replica holds in its engine's LoRA layers now. When loading one more would pass the budget, the least recently used
versions that no call pins are unloaded first (`victims`). A version unloaded here is still in its window: its bytes
stay in Redis, and the next request naming it loads it again, its digest checked again
(rollout_farm/services/replica/adapter_verbs.py). A pinned version is never chosen: when the unpinned ones cannot
make room, nothing is unloaded and the load is refused (the caller's 429 names the setting).

Pure: no engine, no Redis, so that the policy is tested alone (tests/unit/test_adapter_residency.py).
"""

from __future__ import annotations

import itertools

SETTING = "FARM_ADAPTER_BYTES_PER_REPLICA"


def victims(
    loaded: dict[str, tuple[int, int]], last_used: dict[str, int], key: str, need: int, budget: int
) -> list[str] | None:
    """The loaded keys to unload, least recently used first, so that `key` (`need` bytes) fits within `budget`;
    [] when it fits already or the budget is 0 (unbounded); None when it cannot fit even with every unpinned key
    unloaded. `loaded`: key -> (bytes, calls pinning it), every loaded adapter (retiring ones too: they hold bytes
    until their calls end); `last_used`: key -> a clock value (higher: more recent; absent: never used)."""
    if budget <= 0:
        return []
    used = sum(size for k, (size, _) in loaded.items() if k != key)
    over = used + need - budget
    if over <= 0:
        return []
    if need > budget:
        return None
    out = []
    unpinned = [k for k, (_, pins) in loaded.items() if k != key and not pins]
    for k in sorted(unpinned, key=lambda k: last_used.get(k, -1)):
        if over <= 0:
            break
        out.append(k)
        over -= loaded[k][0]
    return out if over <= 0 else None


class Residency:
    """One replica's use clock over its adapter keys, and the byte budget (0: unbounded)."""

    def __init__(self, budget: int):
        self.budget = budget
        self.last_used: dict[str, int] = {}
        self.evictions = 0  # versions unloaded to make room, since the replica started
        self.sizes: dict[str, int] = {}  # key -> the bytes it holds (or will, staged) once loaded
        self._clock = itertools.count()

    def used(self, key: str) -> None:
        """`key` served a call (or was just loaded): the most recently used now."""
        self.last_used[key] = next(self._clock)

    def forget(self, key: str) -> None:
        self.last_used.pop(key, None)
        self.sizes.pop(key, None)

    def victims(self, loaded: dict[str, tuple[int, int]], key: str, need: int) -> list[str] | None:
        return victims(loaded, self.last_used, key, need, self.budget)

    def too_large(self, need: int) -> bool:
        """An adapter of `need` bytes can never be loaded here."""
        return 0 < self.budget < need
