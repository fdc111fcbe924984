"""The torch engine's KV cache kept between a session's turns, so that a turn prefills only its new tokens.

A generate call with a `cache_key` (a session's id; one prompt) leaves, when its row ends, the keys and values of
the tokens its cache holds: the prompt and every sampled token but the last (that one was drawn, never fed). The
next call with that key whose prompt extends those tokens starts from them: its prefill is the last sampled token
and the turn's new tokens (`prefill tokens per turn = new tokens + 1`). Anything else is a miss, and a full prefill:
another policy (the cache was computed on other weights: another base version or adapter), a prompt that does not
extend the tokens (the session forked), or a key this replica never saw (a session that moved here when its replica
died re-prefills once).

Entries are kept least recently used first out, within FARM_ENGINE_SESSION_CACHE_BYTES; Serve's multiplexing
evicts a session's route from the replica (rollout_farm/services/replica/engine_server.py) and with it its entry.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch


@dataclass
class CachedSequence:
    tokens: list[int]
    version: tuple[int, str | None]  # the policy it was computed on: (base weight version, adapter key or None)
    layers: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys and values, (1, heads, len(tokens), dim)

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.layers)


class SessionKV:
    """key -> CachedSequence, bounded in bytes. Thread-safe: the scheduler's thread reads and writes, the replica
    forgets a key from another thread."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, CachedSequence] = OrderedDict()
        self._lock = threading.RLock()  # forget() may run from a garbage-collected route on the scheduler's thread
        self.bytes = 0

    def match(self, key: str, prompt: list[int], version: tuple[int, str | None]) -> CachedSequence | None:
        """The key's cached tokens when the prompt extends them (by one token at least) on this policy."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            n = len(entry.tokens)
            if entry.version != version or n >= len(prompt) or prompt[:n] != entry.tokens:
                return None
            self._entries.move_to_end(key)
            return entry

    def put(self, key: str, entry: CachedSequence) -> None:
        with self._lock:
            self._drop(key)
            if entry.nbytes > self.max_bytes:
                return
            self._entries[key] = entry
            self.bytes += entry.nbytes
            while self.bytes > self.max_bytes:
                self._drop(next(iter(self._entries)))

    def forget(self, key: str) -> None:
        with self._lock:
            self._drop(key)

    def __len__(self) -> int:
        return len(self._entries)

    def _drop(self, key: str) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.bytes -= entry.nbytes
