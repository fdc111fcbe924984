"""Prometheus metrics of the service.

Handlers use them as `metrics.NAME`: Ray Serve ships the FastAPI app to its replica by value,
and only a module reference makes every copy count into the replica's one registry.
"""

from prometheus_client import Counter, Gauge, Histogram

REQUESTS = Counter("farm_requests_total", "HTTP requests", ["path", "status"])
LATENCY = Histogram("farm_request_seconds", "HTTP request latency", ["path"], buckets=(0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 300))
SAMPLES = Counter("farm_samples_total", "Samples delivered by /v1/rollouts", ["sampler"])
TOKENS = Counter("farm_generated_tokens_total", "Tokens of the samples delivered by /v1/rollouts", ["sampler"])
ZERO_VAR = Counter("farm_zero_variance_groups_total", "Delivered groups whose rewards were all equal", ["sampler"])
GROUPS = Counter("farm_groups_total", "Groups delivered by /v1/rollouts", ["sampler"])
STALENESS = Histogram("farm_trajectory_staleness_versions", "Committed version minus the sample's weight version, at delivery", buckets=(0, 1, 2, 4, 8, 16, 64))
VERSION = Gauge("farm_weight_version", "Newest weight version committed through this ingress")
REPLICA_VERSION = Gauge("farm_replica_weight_version", "Weight version each replica serves (read at scrape time)", ["replica"])
REPLICA_TOKENS = Gauge("farm_replica_generated_tokens", "Tokens each replica has generated since it started (read at scrape time)", ["replica"])
SYNC_SECONDS = Histogram("farm_weight_sync_seconds", "Time to load a weight push on every replica", buckets=(0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 120))
SYNC_BYTES = Counter("farm_weight_sync_bytes_total", "Bytes of accepted weight pushes")
POLICY_KL = Gauge("farm_policy_kl", "KL the trainer last reported (POST /v1/policy_stats)")
POLICY_REWARD_VAR = Gauge("farm_policy_reward_variance", "Reward variance the trainer last reported")
POLICY_STEP = Gauge("farm_policy_step", "Trainer step last reported")
SAMPLER_TEMPERATURE = Gauge("farm_sampler_temperature", "Temperature a sampler chose for its last request", ["sampler"])
REPLAYS = Counter("farm_idempotent_replays_total", "Rollout requests answered from an earlier identical request_id")
QUEUE_READY = Gauge("farm_queue_ready_groups", "Queue depth: generated groups waiting to be pulled (read at scrape time)", ["source"])
QUEUE_LEASED = Gauge("farm_queue_leased_groups", "Outstanding leases: pulled groups not yet acked (read at scrape time)", ["source"])
QUEUE_GENERATED = Counter("farm_queue_generated_groups_total", "Groups the queue generated in the background", ["source"])
QUEUE_REDELIVERED = Counter("farm_queue_redeliveries_total", "Groups delivered again after their lease expired", ["source"])
QUEUE_STALE = Counter("farm_queue_stale_dropped_total", "Groups dropped for exceeding a pull's max_staleness", ["source"])
QUEUE_ACKED = Counter("farm_queue_acked_total", "Groups acked by trainers", ["source"])
