"""Prometheus metrics of the service.

Handlers use them as `metrics.NAME`: Ray Serve ships the FastAPI app to its replica by value,
and only a module reference makes every copy count into the replica's one registry.
"""

from prometheus_client import Counter, Gauge, Histogram

REQUESTS = Counter("farm_requests_total", "HTTP requests", ["path", "status"])
LATENCY = Histogram("farm_request_seconds", "HTTP request latency", ["path"], buckets=(0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 300))
SAMPLES = Counter("farm_samples_total", "Samples generated")
TOKENS = Counter("farm_generated_tokens_total", "Tokens generated")
ZERO_VAR = Counter("farm_zero_variance_groups_total", "Groups whose rewards were all equal")
GROUPS = Counter("farm_groups_total", "Groups generated")
VERSION = Gauge("farm_weight_version", "Weight version served by every replica")
SYNC_SECONDS = Histogram("farm_weight_sync_seconds", "Time to load a weight push on every replica", buckets=(0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 120))
SYNC_BYTES = Counter("farm_weight_sync_bytes_total", "Bytes of accepted weight pushes")
REPLAYS = Counter("farm_idempotent_replays_total", "Rollout requests answered from an earlier identical request_id")
