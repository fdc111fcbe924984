"""LoRA training against the real service (two engine replicas): a tenant's run trains a peft adapter for two steps
and pushes only the adapter; the base is never pushed; every sample, training and held-out, comes from the version
just pushed and carries the digest the trainer computed from what it pushed; the adapter changes with training."""

from __future__ import annotations

import torch

from rollout_farm.services import protocol as P
from rollout_farm.trainer.config import load
from tests.adapters import ADMIN

ADAPTER = "lora-e2e"


def test_a_tenant_trains_an_adapter_and_pushes_only_the_adapter(http, service, tiny_model, tmp_path):
    from rollout_farm.trainer.loop import train
    from rollout_farm.trainer.run import TrainingRun

    token = http.post("/v1/tenants/lora-team", headers=ADMIN).json()["token"]
    base_before = http.get("/v1/weights/version").json()
    cfg = load(
        None,
        [
            f"trainer.service_url={service}",
            f"actor_rollout_ref.model.path={tiny_model}",
            "actor_rollout_ref.model.lora_rank=4",
            "actor_rollout_ref.model.lora_alpha=8",
            "trainer.task=arith",
            "trainer.reward=test_float_ties",  # rewards that vary within a group: the advantages are not zero
            "trainer.total_training_steps=2",
            "trainer.eval_size=2",
            "trainer.seed=0",
            f"trainer.default_local_dir={tmp_path}",
            f"trainer.adapter={ADAPTER}",
            "data.train_batch_size=2",
            "data.max_response_length=8",
            "actor_rollout_ref.rollout.n=4",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "actor_rollout_ref.actor.optim.lr=0.05",
        ],
    )
    run = TrainingRun(cfg, token)  # pushes v1, the initial adapter (B = 0: the base)
    asked: list[tuple[P.RolloutRequest, P.RolloutResponse]] = []
    rollouts, base_pushes = run.client.rollouts, []

    def recorded(req):
        asked.append((req, rollouts(req)))
        return asked[-1][1]

    run.client.rollouts = recorded
    for verb in ("push_weights", "push_pieces", "push_weights_path"):  # no base push may happen
        setattr(run.client, verb, lambda *a, verb=verb, **k: base_pushes.append(verb))
    lora_b = {n: p.detach().clone() for n, p in run.policy.named_parameters() if "lora_B" in n}
    summary = train(run)

    # only adapter versions were pushed: v1 at start, then one per step; the base is where it was
    assert not base_pushes and http.get("/v1/weights/version").json()["version"] == base_before["version"]
    info = http.get(f"/v1/adapters/{ADAPTER}", headers={"Authorization": f"Bearer {token}"}).json()
    assert info["owner"] == "lora-team" and [v["version"] for v in info["versions"]] == [1, 2, 3]
    assert {v["version"]: v["digest"] for v in info["versions"]} == run.adapter.digests
    assert summary["final_weight_version"] == run.version == 3
    assert run.report_stats is False  # POST /v1/policy_stats takes the admin's token: skipped for a tenant, not fatal
    # every request named the version just pushed, and every sample carries that version's digest
    train_reqs = [(q, a) for q, a in asked if q.sampling_params.temperature > 0]
    eval_reqs = [(q, a) for q, a in asked if q.sampling_params.temperature == 0]
    assert [q.adapter.version for q, _ in train_reqs] == [1, 2] and {q.adapter.name for q, _ in asked} == {ADAPTER}
    assert [q.adapter.version for q, _ in eval_reqs] == [1, 3] and "before" in summary and "after" in summary
    for q, a in asked:
        for s in (s for g in a.groups for s in g.samples):
            assert s.policy.adapter == ADAPTER and s.policy.adapter_version == q.adapter.version
            assert s.policy.digest == run.adapter.digests[q.adapter.version]
            assert s.policy.base_version == base_before["version"]
    # the adapter moved, and with it the policy the farm serves
    assert any(not torch.equal(lora_b[n], p) for n, p in run.policy.named_parameters() if n in lora_b)
    assert len({run.adapter.digests[v] for v in (1, 2, 3)}) == 3


def test_async_lora_training_through_the_queue_counts_adapter_versions(http, service, tiny_model, tmp_path):
    """The queue source samples the newest adapter version; the staleness bound counts adapter versions (the base
    never moves), and every leased sample's digest is checked. A tenant's token runs it: the source is its own."""
    import json

    from rollout_farm.trainer.loop import train
    from rollout_farm.trainer.run import TrainingRun

    cfg = load(
        None,
        [
            f"trainer.service_url={service}",
            f"actor_rollout_ref.model.path={tiny_model}",
            "actor_rollout_ref.model.lora_rank=4",
            "trainer.task=arith",
            "trainer.reward=test_float_ties",
            "trainer.total_training_steps=3",
            f"trainer.default_local_dir={tmp_path}",
            "trainer.adapter=lora-queue",
            "trainer.rollout_source=queue",
            "async_training.staleness_threshold=1",
            "data.train_batch_size=2",
            "data.max_response_length=8",
            "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "actor_rollout_ref.actor.optim.lr=0.05",
        ],
    )
    token = http.post("/v1/tenants/lora-queue-team", headers=ADMIN).json()["token"]
    run = TrainingRun(cfg, token)
    try:
        train(run)
        owned = http.get("/v1/queue/sources", headers={"Authorization": f"Bearer {token}"}).json()
        assert [q["name"] for q in owned] == ["farm-trainer-lora-queue"]
        assert http.get("/v1/adapters/lora-queue", headers=ADMIN).json()["owner"] == "lora-queue-team"
    finally:
        http.delete("/v1/queue/sources/farm-trainer-lora-queue", headers=ADMIN)
        http.delete("/v1/tenants/lora-queue-team", headers=ADMIN)
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [s["weight_version"] for s in steps] == [2, 3, 4]  # the adapter's versions after each step's push
    assert all(s["staleness_max"] <= 1 for s in steps) and sorted(run.adapter.digests) == [1, 2, 3, 4]
