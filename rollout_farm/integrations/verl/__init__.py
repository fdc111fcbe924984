"""verl 0.9.1 with the farm as its rollout backend (docs/integrations.md, "verl").

Importing this package imports verl: install it with the farm (`verl==0.9.1` is one of its dependencies).

| module | owns |
| --- | --- |
| `sampling.py` | verl's `sampling_params` dict -> the farm's `SamplingParams`, refusing what the farm cannot honour |
| `server.py` | `FarmLLMServerClient`: verl's `LLMServerClient.generate`, answered by `POST /v1/rollouts` |
| `manager.py` | `FarmAgentLoopManager`: verl's `AgentLoopManager` with that client |
| `weights.py` | `push_state_dict`: an actor's tensors to the farm as a new weight version |
"""

from rollout_farm.integrations.verl.manager import FarmAgentLoopManager
from rollout_farm.integrations.verl.sampling import farm_sampling_params
from rollout_farm.integrations.verl.server import FarmLLMServerClient
from rollout_farm.integrations.verl.weights import push_state_dict

__all__ = ["FarmAgentLoopManager", "FarmLLMServerClient", "farm_sampling_params", "push_state_dict"]
