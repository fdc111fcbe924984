"""FarmAgentLoopManager: verl's AgentLoopManager whose agent loops generate on the farm.

verl 0.9.1's trainer builds its agent-loop manager from `actor_rollout_ref.rollout.agent.agent_loop_manager_class`
as `Cls.create(config=, llm_client=, teacher_client=, reward_loop_worker_handles=)`. This one replaces the
llm_client (verl's load balancer over its own vLLM/SGLang servers) with a FarmLLMServerClient; the rest (Ray
agent-loop workers, agent loops, padding into a DataProto) is verl's own. It is the manager of RayPPOTrainer
(`trainer.use_v1=False`); verl's V1 trainer wants an AgentLoopManagerTQ (TransferQueue), not provided here.
"""

from __future__ import annotations

from omegaconf import DictConfig
from verl.experimental.agent_loop.agent_loop import AgentLoopManager

from rollout_farm.integrations.verl.server import FarmLLMServerClient


class FarmAgentLoopManager(AgentLoopManager):
    """AgentLoopManager over the farm; the llm_client verl passes in is not used (see FarmLLMServerClient for
    where the farm's URL and token come from)."""

    def __init__(self, config: DictConfig, llm_client=None, teacher_client=None, reward_loop_worker_handles=None):
        super().__init__(config, FarmLLMServerClient(config), teacher_client, reward_loop_worker_handles)
