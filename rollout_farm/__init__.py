"""rollout-farm: the generation half of LLM reinforcement learning as a horizontally scaled HTTP service.

The public surface is small, as httpx's is: the clients here and the wire models in `rollout_farm.protocol`.
Everything else is inside the three packages, whose layout may move:

| path | what |
| --- | --- |
| `rollout_farm/services/` | the rollout service: a Ray Serve app, its engines, sessions, the client and the wire models
|
| `rollout_farm/trainer/` | the trainer (`farm train`, `farm demo`): a separate process that talks to the service over
HTTP |
| `rollout_farm/integrations/` | adapters that let other RL frameworks (verl) use the farm as their rollout backend |
| `rollout_farm/protocol.py` | the wire models, re-exported for `from rollout_farm.protocol import RolloutRequest` |

```python
from rollout_farm import FarmClient
from rollout_farm.protocol import RolloutRequest
```

The default install (`pip install rollout-farm`) brings only httpx, pydantic and tenacity, enough for both imports.
"""

from rollout_farm.services.client import AsyncFarmClient, FarmClient, FarmError

__all__ = ["FarmClient", "AsyncFarmClient", "FarmError"]
