"""What an engine reports about its batches, for the scrape (rollout_farm/services/observability/metrics.py reads it
through P.ReplicaState):

busy seconds   time with at least one sample generating, since the engine started (1 - its rate: the idle ratio)
batch sizes    per decode step, the rows (samples) in the batch and the generate calls they belong to
prefill        prompt tokens fed through the model, and those a cache saved: a session's KV cache (torch engine), or
               any prefix SGLang's radix cache held (its meta_info cached_tokens); and those the group cache saved
               (torch engine: a prompt fed once for all its rows, or found in the prompt cache)
drafts         with speculative decoding on (torch engine), the drafted tokens verified and those accepted

The torch and bench engines count every decode step; the SGLang engine counts busy time and prefill only (SGLang's
own metrics, e.g. sglang:num_running_reqs, report its batches).
"""

from __future__ import annotations

import bisect
import threading
import time

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)  # upper bounds (le) of the batch-size histograms


class Histogram:
    """Counts per bucket of BATCH_BUCKETS (not cumulative), the last one above the largest bound; their sum and the
    largest value."""

    def __init__(self):
        self.counts = [0] * (len(BATCH_BUCKETS) + 1)
        self.sum, self.max = 0.0, 0

    def observe(self, value: int) -> None:
        self.counts[bisect.bisect_left(BATCH_BUCKETS, value)] += 1
        self.sum += value
        self.max = max(self.max, value)

    def snapshot(self) -> dict:
        return {"bounds": list(BATCH_BUCKETS), "counts": list(self.counts), "sum": self.sum, "max": self.max}


class EngineStats:
    """Thread-safe: the engine's thread writes, the replica's event loop reads."""

    def __init__(self, clock=time.monotonic):
        self.clock = clock
        self._lock = threading.Lock()
        self._busy_since: float | None = None
        self._busy_total = 0.0
        self.rows, self.calls = Histogram(), Histogram()
        self.prefill_tokens = self.reused_tokens = self.shared_tokens = 0
        self.draft_tokens = self.accepted_tokens = 0

    def busy(self, active: bool) -> None:
        """Whether at least one sample is generating now (call it whenever that may have changed)."""
        with self._lock:
            now = self.clock()
            if active and self._busy_since is None:
                self._busy_since = now
            elif not active and self._busy_since is not None:
                self._busy_total += now - self._busy_since
                self._busy_since = None

    def step(self, rows: int, calls: int) -> None:
        """One decode step of `rows` samples from `calls` generate calls."""
        with self._lock:
            self.rows.observe(rows)
            self.calls.observe(calls)

    def prefill(self, fed: int, reused: int, shared: int = 0) -> None:
        """A prefill fed `fed` prompt tokens through the model; `reused` more came from a session's KV cache, and
        `shared` more from the group cache (another row's prefill of the same prompt)."""
        with self._lock:
            self.prefill_tokens += fed
            self.reused_tokens += reused
            self.shared_tokens += shared

    def drafted(self, proposed: int, accepted: int) -> None:
        """A speculative step verified `proposed` drafted tokens and accepted `accepted` of them."""
        with self._lock:
            self.draft_tokens += proposed
            self.accepted_tokens += accepted

    @property
    def busy_seconds(self) -> float:
        with self._lock:
            running = self.clock() - self._busy_since if self._busy_since is not None else 0.0
            return self._busy_total + running

    def snapshot(self) -> dict:
        """busy_seconds, decode_steps, batch_rows, batch_calls and the prefill counts, as P.ReplicaState has them."""
        busy = self.busy_seconds
        with self._lock:
            return {
                "busy_seconds": busy,
                "decode_steps": sum(self.rows.counts),
                "batch_rows": self.rows.snapshot(),
                "batch_calls": self.calls.snapshot(),
                "prefill_tokens": self.prefill_tokens,
                "session_cache_tokens": self.reused_tokens,
                "prefill_shared_tokens": self.shared_tokens,
                "draft_tokens": self.draft_tokens,
                "draft_accepted_tokens": self.accepted_tokens,
            }
