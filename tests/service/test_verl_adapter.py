"""verl 0.9.1 with the farm as its rollout backend (rollout_farm/integrations/verl), against the session's real service.

Which verl layer runs: verl's own `AgentLoopWorker.generate_sequences(DataProto) -> DataProto`, in this process.
That is the method the Ray actors behind verl's AgentLoopManager run for RayPPOTrainer, so everything under it is
verl's code, unchanged: its sampling params from the rollout config (temperature, top_p, top_k,
repetition_penalty, logprobs=calculate_log_probs; val_kwargs when validating), the agent-loop registry and hydra
instantiation, SingleTurnAgentLoop.run with Continuous Token prompt building through the tiny model's tokenizer and
chat template, its ct_merge_assistant_token and truncation, and the padding into prompts/responses/response_mask/
rollout_log_probs. The config is verl's own ppo_trainer.yaml, composed with hydra. `test_agent_loop_manager_on_ray`
goes one layer up: verl's AgentLoopManager (as FarmAgentLoopManager, the agent_loop_manager_class hook) starts a
real AgentLoopWorker Ray actor on the session's Ray cluster and splits the batch to it.

What is faked: nothing of verl's on these paths. What does not run is what needs GPUs or a verl Ray cluster of
FSDP/Megatron workers: RayPPOTrainer itself, verl's LLMServerManager (it launches vLLM/SGLang servers on GPUs) and
the actor workers whose weights a CheckpointEngineManager would sync. The weight push therefore sends a state dict
built here (the tiny model's tensors, perturbed) through push_state_dict, in the (name, tensor) pairs verl's
BaseRollout.update_weights receives.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import ray
import torch
import verl
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
from verl.experimental.agent_loop.agent_loop import AgentLoopWorker
from verl.protocol import DataProto

from rollout_farm.integrations.verl import (
    FarmAgentLoopManager,
    FarmLLMServerClient,
    farm_sampling_params,
    push_state_dict,
)
from rollout_farm.services import protocol as P
from tests.conftest import TOKEN

PROMPT_LENGTH, RESPONSE_LENGTH = 64, 16
QUESTIONS = ["1+1=", "What is 12 times 3?", "Say hi."]


def verl_config(tiny_model, service, **rollout):
    """verl's own ppo_trainer config for the tiny model, with the farm's URL in rollout.custom.farm_url."""
    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    overrides = [
        f"actor_rollout_ref.model.path={tiny_model}",
        "actor_rollout_ref.rollout.name=vllm",  # mandatory in verl's config; nothing here starts vLLM
        f"actor_rollout_ref.rollout.prompt_length={PROMPT_LENGTH}",
        f"actor_rollout_ref.rollout.response_length={RESPONSE_LENGTH}",
        "actor_rollout_ref.rollout.agent.num_workers=1",
        *(f"actor_rollout_ref.rollout.{k}={v}" for k, v in rollout.items()),
    ]
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        config = compose(config_name="ppo_trainer", overrides=overrides)
    OmegaConf.update(config, "actor_rollout_ref.rollout.custom", {"farm_url": service}, force_add=True)
    return config


@pytest.fixture(scope="module")
def config(tiny_model, service):
    return verl_config(tiny_model, service)


@pytest.fixture(scope="module")
def worker(config):
    return AgentLoopWorker(config, FarmLLMServerClient(config, token=TOKEN))


def batch(validate: bool = False) -> DataProto:
    """What verl's trainer hands the agent loops: one chat per row (no agent_name: the default single_turn_agent)."""
    rows = np.empty(len(QUESTIONS), dtype=object)
    rows[:] = [[{"role": "user", "content": q}] for q in QUESTIONS]
    return DataProto.from_dict(non_tensors={"raw_prompt": rows}, meta_info={"validate": validate})


def unpadded(out: DataProto, i: int) -> tuple[list[int], list[int], list[float], list[int]]:
    """Row i's prompt, response, rollout logprobs and response mask, padding removed."""
    b = out.batch
    n_prompt = int(b["attention_mask"][i, :PROMPT_LENGTH].sum())
    n_response = int(b["attention_mask"][i, PROMPT_LENGTH:].sum())
    prompt = b["prompts"][i, PROMPT_LENGTH - n_prompt :].tolist()
    return (
        prompt,
        b["responses"][i, :n_response].tolist(),
        b["rollout_log_probs"][i, :n_response].tolist(),
        b["response_mask"][i].tolist(),
    )


def model_logprobs(model, prompt: list[int], response: list[int]) -> list[float]:
    """log_softmax at temperature 1 of the model for each response token: what the policy assigns them."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(response)[:, None])[:, 0].tolist()


async def test_greedy_validation_batch_is_what_the_farm_returns(worker, client, fresh_weights, tiny_model):
    """verl's validation path (val_kwargs: temperature 0): each row's response and rollout logprobs are the farm's
    greedy sample for the prompt verl built, and the response mask is 1 on it, 0 on the padding."""
    out = await worker.generate_sequences(batch(validate=True))
    assert out.batch["responses"].shape == (len(QUESTIONS), RESPONSE_LENGTH)
    assert out.non_tensor_batch["__num_turns__"].tolist() == [2] * len(QUESTIONS)  # SingleTurnAgentLoop's count
    for i, question in enumerate(QUESTIONS):
        prompt, response, logprobs, mask = unpadded(out, i)
        assert worker.tokenizer.decode(prompt) == f"user: {question}\nassistant:"  # the model folder's template
        greedy = P.SamplingParams(temperature=0, max_new_tokens=RESPONSE_LENGTH)
        req = P.RolloutRequest(prompts=[P.Prompt(token_ids=prompt)], sampling_params=greedy)
        farm = client.rollouts(req).groups[0].samples[0]
        assert response == farm.token_ids and len(response) >= 1
        assert logprobs == pytest.approx(farm.logprobs, abs=1e-5)
        assert mask == [1] * len(response) + [0] * (RESPONSE_LENGTH - len(response))
        assert out.non_tensor_batch["max_global_steps"][i] == fresh_weights


async def test_sampled_batch_logprobs_are_the_policys(worker, fresh_weights, tiny_model):
    """verl's training path (temperature 1, top_k -1, top_p 1, logprobs on): the processed logprobs verl gets are
    the on-disk model's log-probabilities of the tokens the farm sampled."""
    out = await worker.generate_sequences(batch())
    model = AutoModelForCausalLM.from_pretrained(tiny_model, torch_dtype=torch.float32).eval()  # the served weights
    for i in range(len(QUESTIONS)):
        prompt, response, logprobs, mask = unpadded(out, i)
        assert logprobs == pytest.approx(model_logprobs(model, prompt, response), abs=1e-4)
        assert mask == [1] * len(response) + [0] * (RESPONSE_LENGTH - len(response))


async def test_weight_push_through_the_adapter_bumps_the_served_version(
    worker, client, fresh_weights, tiny_model, tmp_path
):
    """push_state_dict sends verl-style (name, tensor) pairs as global step `fresh_weights + 1`, by upload and then
    by shared folder; the service serves each, and verl's batch reports it as global_steps."""
    state = load_file(tiny_model / "model.safetensors")
    torch.manual_seed(0)
    perturbed = ((name, t + 0.5 * torch.randn_like(t)) for name, t in state.items())
    assert push_state_dict(client, perturbed, version=fresh_weights + 1) == fresh_weights + 1
    assert client.weights_version().version == fresh_weights + 1
    out = await worker.generate_sequences(batch(validate=True))
    assert set(out.non_tensor_batch["min_global_steps"]) == {fresh_weights + 1}

    assert push_state_dict(client, state, shared_dir=tmp_path) == fresh_weights + 2
    assert client.weights_version().version == fresh_weights + 2


def test_agent_loop_manager_on_ray(tiny_model, service, fresh_weights, client, monkeypatch):
    """One layer up: verl's AgentLoopManager.create (via FarmAgentLoopManager) starts an AgentLoopWorker Ray actor
    on the session's cluster; the client reaches it pickled, with the token from $FARM_API_TOKEN."""
    monkeypatch.setenv("FARM_API_TOKEN", TOKEN)
    config = verl_config(tiny_model, service)
    manager = FarmAgentLoopManager.create(config=config, llm_client=None)
    try:
        out = manager.generate_sequences(batch(validate=True))
    finally:
        for actor in manager.agent_loop_workers:  # frees its CPU for the rest of the session
            ray.kill(actor)
    for i in range(len(QUESTIONS)):
        prompt, response, logprobs, _ = unpadded(out, i)
        greedy = P.SamplingParams(temperature=0, max_new_tokens=RESPONSE_LENGTH)
        farm = client.rollouts(P.RolloutRequest(prompts=[P.Prompt(token_ids=prompt)], sampling_params=greedy))
        sample = farm.groups[0].samples[0]
        assert response == sample.token_ids and logprobs == pytest.approx(sample.logprobs, abs=1e-5)


@pytest.mark.parametrize(
    "params,key",
    [
        ({"repetition_penalty": 1.1}, "repetition_penalty"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"logprobs": 5}, "logprobs"),
        ({"max_tokens": 8, "max_new_tokens": 8}, "max_new_tokens"),
        ({"top_p": 0.0}, "top_p"),
    ],
)
def test_sampling_params_the_farm_cannot_honour_are_refused_by_name(params, key):
    with pytest.raises(ValueError, match=key):
        farm_sampling_params(params, RESPONSE_LENGTH)


def test_sampling_params_translate():
    """verl's dict as AgentLoopWorker builds it; top_k 0 (HF's "all") is the farm's -1; no max: response_length."""
    verl_params = {"temperature": 0.7, "top_p": 0.9, "top_k": 0, "repetition_penalty": 1.0, "logprobs": True}
    params, logprobs = farm_sampling_params(verl_params, RESPONSE_LENGTH)
    assert logprobs is True
    assert (params.temperature, params.top_p, params.top_k, params.max_new_tokens) == (0.7, 0.9, -1, RESPONSE_LENGTH)
    assert farm_sampling_params({"max_tokens": 5}, RESPONSE_LENGTH)[0].max_new_tokens == 5


async def test_multimodal_inputs_are_refused(config):
    farm = FarmLLMServerClient(config, token=TOKEN)
    with pytest.raises(ValueError, match="image_data"):
        await farm.generate("r", prompt_ids=[5, 6], sampling_params={}, image_data=["an image"])
