"""The Python client of the rollout service, for our trainer and for other frameworks (verl, TRL, ...):
`from rollout_farm.services.client import FarmClient` (or `AsyncFarmClient`; a failed call raises `FarmError`).

| module | owns |
| --- | --- |
| `farm_client.py` | `FarmClient` and `AsyncFarmClient`: each call of the API defined once, sync and async, retries |
| `peft_files.py` | a peft folder's two files, and an adapter upload's body made from them (stdlib only) |
| `calls.py` | one call on the wire: its answer or `FarmError`, whether to send it again, a streamed rollout's lines |
"""

from rollout_farm.services.client.calls import FarmError
from rollout_farm.services.client.farm_client import AsyncFarmClient, FarmClient

__all__ = ["AsyncFarmClient", "FarmClient", "FarmError"]
