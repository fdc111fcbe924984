"""The queue's Prometheus gauges, read from each ingress replica's last queue states at scrape time."""

from __future__ import annotations

import weakref

from prometheus_client import REGISTRY
from prometheus_client.core import GaugeMetricFamily


class QueueGauges:
    """Per source, as of the last states() (GET /metrics refreshes them before it renders): farm_queue_ready_groups,
    farm_queue_leased_groups, and the generation loop's seconds busy and idle since the source was added
    (farm_queue_generation_busy_seconds, farm_queue_generation_idle_seconds). Those two live in Redis, so every
    ingress replica reports the same figure: they are gauges (the scrape keeps one replica's), not counters (which
    it would sum over replicas). The rollout idle ratio over a window is idle / (idle + busy) of their increases."""

    def __init__(self):
        self.queues: weakref.WeakSet = weakref.WeakSet()

    def collect(self):
        ready = GaugeMetricFamily(
            "farm_queue_ready_groups", "Queue depth: generated groups waiting to be pulled", labels=["source"]
        )
        leased = GaugeMetricFamily(
            "farm_queue_leased_groups", "Outstanding leases: pulled groups not yet acked", labels=["source"]
        )
        busy = GaugeMetricFamily(
            "farm_queue_generation_busy_seconds",
            "Seconds the source's generation loop spent generating, since the source was added",
            labels=["source"],
        )
        idle = GaugeMetricFamily(
            "farm_queue_generation_idle_seconds",
            "Seconds the source's generation loop had nothing it was allowed to generate (no prompt pending, or "
            "target_groups ready), since the source was added",
            labels=["source"],
        )
        for queue in self.queues:
            for s in queue.snapshot:
                ready.add_metric([s.name], s.ready)
                leased.add_metric([s.name], s.leased)
                busy.add_metric([s.name], s.generation_busy_s)
                idle.add_metric([s.name], s.generation_idle_s)
        return [ready, leased, busy, idle]


GAUGES = QueueGauges()
REGISTRY.register(GAUGES)
