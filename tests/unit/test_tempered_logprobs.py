"""The trainer's policy is the one it samples from: rollout_farm/trainer/loop.py policy_and_reference_pass (the no-grad
pass of every step) divides the logits by the temperature each sample was drawn at
(rollout_farm/trainer/algorithms/forward.py `temperatures`). Checked against the tiny Llama's own logits divided by
hand; `logits_temperature=none` is the negative control (the raw logprobs, which differ at T = 0.5). A mutant that
divides by nothing fails here."""

import types

import pytest
import torch
from transformers import AutoModelForCausalLM

from rollout_farm.services import protocol as P
from rollout_farm.trainer import loop
from rollout_farm.trainer.batch import make_batch
from rollout_farm.trainer.config import load

PROMPT, RESPONSE = [1, 2, 3], [5, 6, 7]


def sample(temperature: float) -> P.Sample:
    return P.Sample(
        token_ids=RESPONSE,
        logprobs=[-1.0] * 3,
        sampling_logprobs=[-1.0] * 3,
        text="x",
        finish_reason="length",
        weight_version=0,
        sampled_with=P.SampledWith(temperature=temperature, top_p=1.0, top_k=-1),
    )


def by_hand(model, temperature: float) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT + RESPONSE])).logits[0]
    steps = logits[len(PROMPT) - 1 : len(PROMPT) - 1 + len(RESPONSE)] / temperature
    return torch.log_softmax(steps.float(), -1).gather(-1, torch.tensor(RESPONSE)[:, None]).squeeze(-1)


@pytest.mark.parametrize("mode", ["sampled", "none"])
def test_the_step_reads_each_samples_tempered_logprobs(tiny_model, mode):
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    cfg = load(None, [f"actor_rollout_ref.actor.logits_temperature={mode}"])
    run = types.SimpleNamespace(cfg=cfg, policy=model, ref=model)
    group = P.Group(
        prompt_token_ids=PROMPT, samples=[sample(0.5), sample(1.0)], reward_mean=0, reward_std=0, zero_variance=True
    )
    old_lp, ref_lp, *_ = loop.policy_and_reference_pass(run, make_batch([group], pad_id=0))
    for row, t in enumerate([0.5, 1.0]):
        expected = by_hand(model, t if mode == "sampled" else 1.0)
        assert torch.allclose(old_lp[row, :3], expected, atol=1e-5), (row, old_lp[row], expected)
        assert torch.allclose(ref_lp[row, :3], expected, atol=1e-5)
    assert not torch.allclose(by_hand(model, 0.5), by_hand(model, 1.0), atol=1e-3)  # T = 0.5 reads differently
