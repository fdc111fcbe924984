"""The pull-mode trajectory queue: groups generated ahead of the trainer, leased and acked, in Redis Streams.

| module | owns |
| --- | --- |
| `trajectory_queue.py` | `TrajectoryQueue`: sources, prompts added, pulls (leases), acks, staleness drops |
| `generation.py` | generation ahead: one owner replica per source, a batch to `generating`, groups landed atomically |
| `store.py` | each source's Redis keys, the Lua scripts that add and settle entries atomically, the JSON entries |
| `gauges.py` | ready, leased and pending counts per source, read at scrape time |
"""
