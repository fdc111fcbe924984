"""rollout-farm: the generation half of LLM reinforcement learning as a horizontally scaled HTTP service.

The public surface is small, as httpx's is: the clients here and the wire models in `rollout_farm.protocol`.
Everything else is inside the three packages below, whose layout may move.

```python
from rollout_farm import FarmClient
from rollout_farm.protocol import RolloutRequest
```

The default install (`pip install rollout-farm`) brings only httpx, pydantic and tenacity, enough for both imports.

| module | owns |
| --- | --- |
| `services/` | the rollout service: the Ray Serve app, engines, sessions, the client and the wire models |
| `trainer/` | the trainer (`farm train`, `farm demo`, the `farm` command): a separate process, HTTP only |
| `integrations/` | adapters that let other RL frameworks (verl) use the farm as their rollout backend |
| `protocol.py` | the wire models, re-exported from `services/protocol/` |
"""

from rollout_farm.services.client import AsyncFarmClient, FarmClient, FarmError

__all__ = ["FarmClient", "AsyncFarmClient", "FarmError"]
