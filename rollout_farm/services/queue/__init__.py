"""The pull-mode trajectory queue: groups generated ahead of the trainer, leased and acked, in Redis Streams.

The path of a prompt through this package:

  trajectory_queue.py  TrajectoryQueue: sources (POST /v1/queue/sources), prompts added, pulls (leases), acks,
                       staleness drops; what rollout_farm/services/api/queue.py calls
  generation.py        the owner of a source (one ingress replica) moves a batch of prompts to `generating`,
                       generates it through the rollout Fanout, and lands the groups in the source's stream
  store.py             each source's Redis keys, the Lua scripts that add and settle entries atomically, the JSON
                       entries
  gauges.py            ready, leased and pending counts per source, read at scrape time
"""
