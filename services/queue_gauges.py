"""The queue's Prometheus gauges, read from each ingress replica's last queue states at scrape time."""

from __future__ import annotations

import weakref

from prometheus_client import REGISTRY
from prometheus_client.core import GaugeMetricFamily


class QueueGauges:
    """farm_queue_ready_groups and farm_queue_leased_groups per source, as of the last states() (GET /metrics
    refreshes them before it renders)."""

    def __init__(self):
        self.queues: weakref.WeakSet = weakref.WeakSet()

    def collect(self):
        ready = GaugeMetricFamily(
            "farm_queue_ready_groups", "Queue depth: generated groups waiting to be pulled", labels=["source"]
        )
        leased = GaugeMetricFamily(
            "farm_queue_leased_groups", "Outstanding leases: pulled groups not yet acked", labels=["source"]
        )
        for queue in self.queues:
            for s in queue.snapshot:
                ready.add_metric([s.name], s.ready)
                leased.add_metric([s.name], s.leased)
        return [ready, leased]


GAUGES = QueueGauges()
REGISTRY.register(GAUGES)
