"""verl's own ToolAgentLoop (multi-turn, tools) generating through rollout_farm.integrations.verl.FarmLLMServerClient:
verl's AgentLoopWorker, its hermes tool parser, its function tool and its token bookkeeping run unchanged; the farm
samples.

The model is the bench app's EchoEngine, the scripted agent model (tests/farm_plugins.py): the user message scripts
a hermes tool call, and the tool's answer (tests/verl_tools.py) scripts the final answer. Nothing of verl's is faked.
"""

from __future__ import annotations

import numpy as np
from verl.experimental.agent_loop.agent_loop import AgentLoopWorker
from verl.protocol import DataProto

from rollout_farm.integrations.verl import FarmLLMServerClient
from rollout_farm.services.models import byte_tokenizer
from tests.conftest import TOKEN
from tests.service.test_verl_adapter import verl_config

PROMPT, RESPONSE = 512, 512  # the scripted turns are long in bytes (one token each)
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "37*48"}}</tool_call>'


async def test_verl_tool_agent_loop_runs_a_tool_episode_on_the_farm(tiny_model, bench_service):
    tools = str(__import__("pathlib").Path(__file__).parent.parent / "verl_tools.py")
    config = verl_config(
        tiny_model,
        bench_service,
        **{
            "temperature": 0,
            "multi_turn.enable": True,
            "multi_turn.format": "hermes",
            "multi_turn.function_tool_path": tools,
            "multi_turn.max_assistant_turns": 4,
            "calculate_log_probs": True,
            "prompt_length": PROMPT,
            "response_length": RESPONSE,
        },
    )
    worker = AgentLoopWorker(config, FarmLLMServerClient(config, token=TOKEN))
    rows = np.empty(2, dtype=object)
    rows[:] = [[{"role": "user", "content": f"What is 37*48? say:‹{CALL}›"}]] * 2
    agents = np.array(["tool_agent"] * 2, dtype=object)
    out = await worker.generate_sequences(
        DataProto.from_dict(non_tensors={"raw_prompt": rows, "agent_name": agents}, meta_info={"validate": True})
    )
    tok = byte_tokenizer()
    b = out.batch
    for i in range(2):
        n = int(b["attention_mask"][i, PROMPT:].sum())
        response, mask = b["responses"][i, :n].tolist(), b["response_mask"][i, :n].tolist()
        text = tok.decode(response)
        assert text.startswith(CALL) and text.endswith("The answer is 1776.")  # the call, then the answer
        assert "1776 say:‹The answer is 1776.›" in text  # the tool's answer, rendered by verl between the turns
        sampled = tok.decode([t for t, m in zip(response, mask) if m])
        assert sampled == CALL + "The answer is 1776."  # verl's mask: 1 exactly on what the farm sampled
        assert all(lp != 0 for lp, m in zip(b["rollout_log_probs"][i, :n].tolist(), mask) if m)
    assert out.non_tensor_batch["__num_turns__"].tolist() == [4, 4]  # user, assistant, tool, assistant
