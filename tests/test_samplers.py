"""Sampler plug-ins: the policy statistics the trainer reports, and the KL-adaptive temperature sampler."""

import statistics

import httpx
import pytest

from services import protocol as P
from services.samplers import KLAdaptiveParams, KLAdaptiveTemperature
from tests.conftest import TOKEN

AUTH = {"Authorization": f"Bearer {TOKEN}"}


def report(service, **stats):
    r = httpx.post(f"{service}/v1/policy_stats", json=stats, headers=AUTH)
    assert r.status_code == 200, r.text
    return r.json()


def rollout(service, sampler_params, n=16):
    body = {"prompts": [{"text": "hello"}, {"text": "Q: 3+4\nA:"}], "n": n, "sampling_params": {"max_new_tokens": 16, "ignore_eos": True},
            "sampler": {"name": "kl_adaptive_temperature", "params": sampler_params}}
    r = httpx.post(f"{service}/v1/rollouts", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return [s for g in r.json()["groups"] for s in g["samples"]]


def test_the_temperature_follows_the_reported_kl(service):
    cool = {"base_temperature": 2.0, "low_temperature": 0.0, "kl_threshold": 0.02}  # 0: greedy, so its effect is plain to see
    report(service, kl=0.001, step=1)
    hot = rollout(service, cool)
    assert {s["sampler_meta"]["temperature"] for s in hot} == {2.0} and hot[0]["sampler_meta"]["kl"] == 0.001
    report(service, kl=0.05, step=2)
    cold = rollout(service, cool)
    assert {s["sampler_meta"]["temperature"] for s in cold} == {0.0}
    # the engines really sampled that way: greedy repeats one sample per prompt, T=2 almost never does,
    # and greedy picks the most likely tokens (higher raw-model logprobs)
    distinct = lambda samples: len({tuple(s["token_ids"]) for s in samples})  # noqa: E731
    assert distinct(cold) == 2 and distinct(hot) >= 30
    mean = lambda samples: statistics.fmean(lp for s in samples for lp in s["logprobs"])  # noqa: E731
    assert mean(cold) > mean(hot)
    text = httpx.get(f"{service}/metrics").text
    assert 'farm_sampler_temperature{sampler="kl_adaptive_temperature"} 0.0' in text and "farm_policy_kl 0.05" in text
    assert "farm_policy_step 2.0" in text
    assert report(service, reward_var=0.25) == {"kl": 0.05, "reward_var": 0.25, "step": 2}  # fields left out keep their value


def test_smooth_schedule_moves_monotonically_through_the_midpoint():
    s = KLAdaptiveTemperature(KLAdaptiveParams(schedule="smooth", base_temperature=0.7, low_temperature=0.5, kl_threshold=0.02, smooth_width=0.005))
    temps = [s.temperature(kl) for kl in (0.0, 0.01, 0.015, 0.02, 0.025, 0.03, 0.1)]
    assert all(a > b for a, b in zip(temps, temps[1:]))
    assert temps[3] == pytest.approx(0.6) and temps[0] == pytest.approx(0.7, abs=1e-3) and temps[-1] == pytest.approx(0.5, abs=1e-6)
    assert s.temperature(None) == 0.7


def test_the_client_reports_policy_stats(client):
    assert client.report_policy_stats(P.PolicyStats(step=7)).step == 7


def test_policy_stats_need_the_token_and_valid_fields(service):
    assert httpx.post(f"{service}/v1/policy_stats", json={"kl": 0.1}).status_code == 401
    bad = httpx.post(f"{service}/v1/policy_stats", json={"kl": -1}, headers=AUTH)
    assert bad.status_code == 422 and bad.json()["detail"][0]["field"] == "kl"
    assert httpx.post(f"{service}/v1/policy_stats", json={"kll": 1}, headers=AUTH).json()["detail"][0]["field"] == "kll"
    assert set(httpx.get(f"{service}/v1/policy_stats").json()) == {"kl", "reward_var", "step"}


def test_invalid_sampler_params_get_422_naming_the_field(service):
    body = {"prompts": [{"text": "hi"}], "sampler": {"name": "kl_adaptive_temperature", "params": {"base_temperature": 0.3, "low_temperature": 0.9}}}
    r = httpx.post(f"{service}/v1/rollouts", json=body)
    assert r.status_code == 422 and r.json()["detail"][0]["field"].startswith("sampler.params") and "low_temperature" in r.json()["detail"][0]["message"]
    body["sampler"]["params"] = {"schedule": "cosine"}
    assert httpx.post(f"{service}/v1/rollouts", json=body).json()["detail"][0]["field"] == "sampler.params.schedule"
    assert "kl_adaptive_temperature" in httpx.get(f"{service}/v1/samplers").json()


def fake_samples(rewards):
    """Scored candidates as the replica builds them (only the reward matters to the resampler)."""
    return [P.Sample(token_ids=[1], logprobs=[0.0], text="", finish_reason="stop", reward=r, weight_version=0, sampler_meta={"sampler": "x"})
            for r in rewards]


def test_importance_resampling_reproduces_the_tilted_target_and_its_weights_undo_it():
    import math
    import random

    from services.samplers import ImportanceParams, ImportanceResampling

    beta, p, m, n, groups = 1.0, 0.3, 64, 4, 3000
    sampler, rng, draw = ImportanceResampling(ImportanceParams(candidates=m, beta=beta)), random.Random(0), random.Random(1)
    delivered = [s for _ in range(groups) for s in sampler.select(fake_samples([float(draw.random() < p) for _ in range(m)]), n, rng)]
    target = p * math.exp(beta) / (1 - p + p * math.exp(beta))  # E[r] under q ∝ p(x) exp(beta r)
    mean = statistics.fmean(s.reward for s in delivered)
    sem = statistics.pstdev(s.reward for s in delivered) / math.sqrt(groups)  # groups are the independent units; n per group share candidates
    assert abs(mean - target) < 4 * sem * math.sqrt(n) + 1 / m  # within the CI, plus the O(1/m) bias of self-normalisation
    weights = [s.sampler_meta["importance_weight"] for s in delivered]
    corrected = sum(w * s.reward for w, s in zip(weights, delivered)) / sum(weights)
    assert abs(corrected - p) < 0.02  # the returned weights take the trainer back to the behaviour policy's expectation
    assert len(delivered) == groups * n and delivered[0].sampler_meta["candidates"] == m and delivered[0].sampler_meta["sampler"] == "x"


def test_importance_resampling_generates_m_candidates_and_returns_n(service):
    body = {"prompts": [{"text": "hi"}, {"text": "ho"}], "n": 3, "sampling_params": {"max_new_tokens": 8, "ignore_eos": True, "seed": 5},
            "sampler": {"name": "importance_resampling", "params": {"candidates": 8, "beta": 2.0}}}
    before = sum(s["generated_tokens"] for s in httpx.get(f"{service}/readyz").json()["replicas"])
    r = httpx.post(f"{service}/v1/rollouts", json=body, timeout=120)
    assert r.status_code == 200, r.text
    after = sum(s["generated_tokens"] for s in httpx.get(f"{service}/readyz").json()["replicas"])
    assert after - before == 2 * 8 * 8  # 8 candidates of 8 tokens per prompt were generated
    for g in r.json()["groups"]:
        assert len(g["samples"]) == 3
        for s in g["samples"]:  # no reward: every candidate weighs the same
            assert s["sampler_meta"] == {"sampler": "importance_resampling", "importance_weight": 1.0, "candidates": 8, "ess": 8.0}
