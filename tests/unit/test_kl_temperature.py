"""The guards and the adaptive KL controller read the KL to the reference at one fixed temperature
(algorithm.kl_temperature, 1.0 by default), not at each sample's own: rollout_farm/trainer/loop.py train_step on the
same weights and the same tokens, drawn once at T = 0.5 and once at T = 0.7 (what the kl_adaptive_temperature sampler
switches between). The reading at the sample's temperature is logged beside it (kl_ref_sampled).

Real tiny Llama policy and a perturbed copy as the reference; only the PPO epochs are skipped (the update is not
what is checked here). The negative control is `kl_temperature=null`, the old reading: there the controller's
input and its coefficient move with the sampler's temperature, and the test shows it.

Mutations tried, each failing here: the fixed and the sampled readings swapped in train_step's kl_readings call;
updated_kl returning (sampled, fixed); policy_and_reference ignoring kl_temperature."""

import copy
import types

import pytest
import torch
from transformers import AutoModelForCausalLM
from verl.trainer.ppo import core_algos

from rollout_farm.services import protocol as P
from rollout_farm.trainer import loop
from rollout_farm.trainer.batch import make_batch
from rollout_farm.trainer.config import load

PROMPT, RESPONSES = [1, 2, 3], [[5, 6, 7, 8], [9, 4, 6, 2]]
ADAPTIVE = ["algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.horizon=16"]


@pytest.fixture(scope="module")
def models(tiny_model):
    policy = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    ref = copy.deepcopy(policy)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        head = ref.get_output_embeddings().weight
        head.add_(0.3 * head.std() * torch.randn(head.shape, generator=g))
    return policy, ref


def batch(temperature: float):
    samples = [
        P.Sample(
            token_ids=ids,
            logprobs=[-1.0] * len(ids),
            text="x",
            finish_reason="length",
            weight_version=0,
            reward=float(i),
            sampled_with=P.SampledWith(temperature=temperature, top_p=1.0, top_k=-1),
        )
        for i, ids in enumerate(RESPONSES)
    ]
    group = P.Group(prompt_token_ids=PROMPT, samples=samples, reward_mean=0.5, reward_std=0.5, zero_variance=False)
    return make_batch([group], pad_id=0)


def by_hand(models, temperature: float) -> float:
    """The exact per-token KL at `temperature`, averaged over the response tokens, from the models' own logits."""
    policy, ref = models
    total, n = 0.0, 0
    for ids in RESPONSES:
        x = torch.tensor([PROMPT + ids])
        with torch.no_grad():
            lp = torch.log_softmax(policy(x).logits[0].float() / temperature, -1)
            rp = torch.log_softmax(ref(x).logits[0].float() / temperature, -1)
        steps = slice(len(PROMPT) - 1, len(PROMPT) - 1 + len(ids))
        total += (lp.exp() * (lp - rp)).sum(-1)[steps].sum().item()
        n += len(ids)
    return total / n


def step(monkeypatch, models, temperature: float, kl_temperature: str) -> tuple[dict, float]:
    """train_step on the batch drawn at `temperature`: its metrics and the controller's coefficient after it."""
    # the target between the two sample-temperature readings: the controller moves beta up on one and down on the
    # other if it reads them (its step is clipped at +-20%, so a target far from both would hide the difference)
    target = (by_hand(models, 0.5) + by_hand(models, 0.7)) / 2
    cfg = load(None, [*ADAPTIVE, f"algorithm.kl_ctrl.target_kl={target}", f"algorithm.kl_temperature={kl_temperature}"])
    policy, ref = models
    run = types.SimpleNamespace(
        cfg=cfg,
        policy=policy,
        ref=ref,
        critic=None,
        version=0,
        kl_ctrl=core_algos.get_kl_controller(cfg.algorithm.kl_ctrl),
    )
    monkeypatch.setattr(loop, "ppo_update", lambda *a, **k: {})
    return loop.train_step(run, batch(temperature)), run.kl_ctrl.value


def test_the_guards_and_the_controller_read_the_kl_at_one_temperature(monkeypatch, models):
    at_1 = by_hand(models, 1.0)
    (cold, cold_beta), (warm, warm_beta) = (step(monkeypatch, models, t, "1.0") for t in (0.5, 0.7))
    for m in (cold, warm):
        assert m["kl_ref_before"] == pytest.approx(at_1, rel=1e-4)  # the controller's input
        assert m["kl_ref"] == pytest.approx(at_1, rel=1e-4)  # the guards' and the samplers'
    assert cold_beta == pytest.approx(warm_beta, rel=1e-9)
    # logged beside it: each sample's own temperature, which moves with the sampler
    assert cold["kl_ref_sampled"] == pytest.approx(by_hand(models, 0.5), rel=1e-4)
    assert warm["kl_ref_sampled"] == pytest.approx(by_hand(models, 0.7), rel=1e-4)
    assert cold["kl_ref_before_sampled"] == pytest.approx(by_hand(models, 0.5), rel=1e-4)


def test_negative_control_reading_at_the_samples_temperature_moves_with_the_sampler(monkeypatch, models):
    (cold, cold_beta), (warm, warm_beta) = (step(monkeypatch, models, t, "null") for t in (0.5, 0.7))
    assert cold["kl_ref"] == pytest.approx(by_hand(models, 0.5), rel=1e-4)
    assert warm["kl_ref"] == pytest.approx(by_hand(models, 0.7), rel=1e-4)
    assert cold["kl_ref"] > 1.2 * warm["kl_ref"]  # the same weights, read 1.2x+ higher at the colder sampler
    assert cold_beta > 1.01 * warm_beta  # so the controller moves beta one way at T = 0.5, the other at 0.7
