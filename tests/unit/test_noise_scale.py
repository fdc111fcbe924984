"""The gradient noise scale (rollout_farm/trainer/algorithms/noise_scale.py): the estimator recovers a known
tr(Σ)/|G|², the actor step measures each micro-batch's own mean gradient, and the guard can act on it."""

import pytest
import torch

from rollout_farm.trainer.actor import ActorInputs, update_actor
from rollout_farm.trainer.algorithms.forward import response_logprobs
from rollout_farm.trainer.algorithms.noise_scale import noise_parts, noise_scale
from rollout_farm.trainer.config import ConfigError, load
from rollout_farm.trainer.minibatches import MiniBatch
from tests.unit.enumeration import Bigram, sequences
from tests.unit.test_kl_reading import every_sequence


def simulate(rescale: bool, draws: int = 3000, d: int = 40, K: int = 4, b: int = 8) -> float:
    """Per-sample gradients μ + ε (|μ|² = 1, tr Σ = 20, so B_simple = 20) in K micro-batches of b samples. The
    actor accumulates each micro-batch's gradient times its share 1/K; rescale divides it back out."""
    g = torch.Generator().manual_seed(0)
    mu = torch.randn(d, generator=g)
    mu /= mu.norm()
    sigma = (20 / d) ** 0.5
    traces, g2s = [], []
    for _ in range(draws):
        micro = mu + sigma * torch.randn(K, b, d, generator=g).mean(1)  # (K, d): each micro-batch's mean gradient
        added = micro / K  # what each backward adds to .grad
        small = (added * K if rescale else added).pow(2).sum(-1).tolist()
        trace, g2 = noise_parts(small, [b] * K, float(added.sum(0).pow(2).sum()), K * b)
        traces.append(trace), g2s.append(g2)
    return noise_scale(traces, g2s)


def test_the_estimator_recovers_a_known_noise_scale_and_rejects_unscaled_micro_gradients():
    assert simulate(rescale=True) == pytest.approx(20, rel=0.1)
    wrong = simulate(rescale=False)  # negative control: the micro-batch's share left in
    assert wrong is None or not 10 < wrong < 30


def test_one_micro_batch_per_mini_batch_measures_nothing():
    assert noise_parts([2.0], [8], 2.0, 8) == (0.0, 0.0)
    assert noise_scale([0.0], [0.0]) is None


def share_of(b, idx) -> dict:
    tokens = b.response_mask[idx].sum(-1)
    return {"batch_num_tokens": int(tokens.sum()), "global_batch_size": int((tokens > 0).sum())}


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_the_actor_step_measures_each_micro_batch_as_its_own_mini_batch(mode):
    """update_actor in micro-batches of 4 gives the noise parts computed from each half trained alone (its own
    mean gradient) and the whole. Responses of unequal lengths make token and sample shares differ."""
    V, L = 4, 3
    g = torch.Generator().manual_seed(3)
    policy = Bigram(torch.randn(V, V, generator=g))
    b = every_sequence(sequences(V, L)[torch.randperm(V**L, generator=g)[:8]], 1.0)
    b.response_mask[:3, 2] = 0  # three shorter responses, all in the first micro-batch
    with torch.no_grad():
        old_lp = response_logprobs(policy, b, b.temperatures)[0]
    adv, weights = torch.randn(8, L, generator=g), torch.ones(8, L)
    cfg = load(
        None,
        [
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
            "actor_rollout_ref.actor.grad_clip=1e9",
            f"actor_rollout_ref.actor.loss_agg_mode={mode}",
        ],
    ).actor_rollout_ref.actor
    opt = torch.optim.SGD(policy.parameters(), lr=0.0)  # leaves the gradients to read, and the weights as they are

    def step(idx, measure):
        inputs = ActorInputs(policy, b, adv, old_lp, old_lp, weights, cfg)
        row = update_actor(inputs, opt, MiniBatch(idx, share_of(b, idx)), measure)
        return row, float(policy.table.grad.pow(2).sum())

    row, whole = step(torch.arange(8), True)
    halves = [step(idx, False)[1] for idx in (torch.arange(4), torch.arange(4, 8))]
    trace, g2 = noise_parts(halves, [4, 4], whole, 8)
    assert row["grad_noise_trace"] == pytest.approx(trace, rel=1e-5)
    assert row["grad_noise_g2"] == pytest.approx(g2, rel=1e-5)
    assert "grad_noise_trace" not in step(torch.arange(8), False)[0]  # measured only when asked


def test_the_noise_scale_guard_raises_the_mini_batch_above_the_critical_batch():
    from rollout_farm.trainer.guards.checks import Guard, GuardConfig

    guard = Guard(GuardConfig(enable=True, variance_statistic="grad_noise_scale", variance_raise=1.0))
    base = {"reward_std": 0.0, "reward_var": 0.0, "adv_var": 0.0}
    assert guard.check(0.0, base | {"grad_noise_scale": 2.5}, 8)[0] == ["raise_mini_batch"]
    assert guard.check(0.0, base | {"grad_noise_scale": 0.5}, 8)[0] == []
    assert guard.check(0.0, base | {"grad_noise_scale": float("inf")}, 8)[0] == ["raise_mini_batch"]


def test_the_noise_scale_statistic_needs_micro_batches():
    with pytest.raises(ConfigError, match="ppo_micro_batch_size_per_gpu below the 256 samples"):
        load(None, ["guards.variance_statistic=grad_noise_scale"])
    cfg = load(
        None, ["guards.variance_statistic=grad_noise_scale", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=64"]
    )
    assert cfg.guards.variance_statistic == "grad_noise_scale"
