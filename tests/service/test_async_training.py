"""Async training against the real service: the trainer's own queue code (rollout_farm/trainer/sync/rollouts.py
lease_groups, which feeds s steps ahead and leases with the bound) between weight pushes, and the batch it builds from
what arrives.

  - the staleness bound: no sample whose oldest token is more than s versions behind the trainer arrives, even when
    versions jump past the groups generated ahead; with a larger s the same old groups do arrive (the test can fail);
  - a weight commit landing while the queue generates, pushed the trainer's way (rollout_farm/trainer/sync/weights.py's
    push_weights with the async in-flight policy, bucketed): with "partial" each sample's tokens switch version
    mid-way and the batch records each token's version and the staleness of the oldest; with "abort" the samples
    run again on the new weights, one version each;
  - the generation loop's busy and idle seconds, in the source's state and in /metrics.
"""

import random
import types

import httpx
import pytest
import torch
from safetensors.torch import save
from transformers import AutoModelForCausalLM

from rollout_farm.services import protocol as P
from rollout_farm.services.client import FarmClient
from rollout_farm.services.extensions.tasks import TASKS
from rollout_farm.services.weights.pusher import WeightPusher
from rollout_farm.trainer.batch import make_batch
from rollout_farm.trainer.config import load
from rollout_farm.trainer.outputs import staleness_metrics
from rollout_farm.trainer.sync import rollouts
from rollout_farm.trainer.sync.weights import push_weights
from tests.conftest import TOKEN
from tests.service.helpers import AUTH, LONG_TOKENS, in_thread, perturbed, replicas, wait_until

BENCH_WEIGHTS = save({"bench.weight": torch.zeros(1)})


def trainer_stub(client: FarmClient, source: str, s: int, batch: int, steps: int):
    """What lease_groups reads of a TrainingRun: the config, client, RNG, task, tokenizer, counters, version."""
    cfg = load(
        None,
        [
            "trainer.rollout_source=queue",
            f"trainer.queue_source={source}",
            f"async_training.staleness_threshold={s}",
            f"data.train_batch_size={batch}",
            "actor_rollout_ref.rollout.n=2",
            f"trainer.total_training_steps={steps}",
        ],
    )
    return types.SimpleNamespace(
        cfg=cfg,
        client=client,
        rng=random.Random(0),
        task=TASKS.get("arith")(),
        tok=types.SimpleNamespace(chat_template=None),
        pulls=0,
        batches=0,
        run_id=source,
        version=client.weights_version().version,
        pull_stats={},
        queue_clock=None,
        leased=[],
        redelivered=0,
        generated_tokens=0,
    )


def pull_step(run) -> list[P.Group]:
    """One step's pull as the trainer makes it; the groups acked at once (the step is done with them)."""
    run.pulls += 1
    groups = rollouts.lease_groups(run)
    run.client.queue_ack(run.leased)
    return groups


def state(client: FarmClient, source: str) -> P.QueueSourceState:
    return next(s for s in client.queue_sources() if s.name == source)


@pytest.mark.parametrize("s", [1, 3])
def test_no_sample_older_than_the_bound_reaches_the_trainer(bench_service, s):
    """Steps of 2 groups. Before the first push the groups of the steps fed ahead are all generated; then the
    versions jump by 3 (a push per step plus two more, as rollbacks make). With s=1 those groups are 3 versions
    behind: dropped and generated again, and no sample past 1 arrives. With s=3 the next step's arrive 3 behind
    (those of the steps after, 4 behind by then, are dropped)."""
    source = f"async-bound-{s}"
    with FarmClient(bench_service, TOKEN, retries=0) as client:
        run = trainer_stub(client, source, s, batch=2, steps=5)
        lags, dropped = [], 0
        try:
            for step in range(1, 6):
                groups = pull_step(run)
                dropped += run.pull_stats["stale_dropped_groups"] + run.pull_stats["refused_groups"]
                b = make_batch(groups, pad_id=0)
                lags += staleness_metrics.sample_staleness(b, run.version).tolist()
                if step == 1:  # everything fed so far generated, on the first version, before the versions move
                    wait_until(lambda: state(client, source).ready >= 2 * s, "the groups fed ahead generated")
                for _ in range(3 if step == 1 else 1):  # the step's push (and two more after the first)
                    run.version += 1
                    assert client.push_weights(BENCH_WEIGHTS, run.version, policy="partial").version == run.version
        finally:
            client.queue_remove_source(source)
    assert len(lags) == 5 * 2 * 2 and min(lags) >= 0
    if s == 1:
        assert max(lags) <= 1 and dropped >= 2, (lags, dropped)
    else:  # the negative control: a looser bound lets the groups generated three versions ago through
        assert max(lags) == 3, (lags, dropped)


def test_the_generation_loop_reports_its_busy_and_idle_time(bench_service):
    source = "async-idle"
    with FarmClient(bench_service, TOKEN, retries=0) as client:
        run = trainer_stub(client, source, 1, batch=2, steps=3)
        try:
            for _ in range(3):
                pull_step(run)
            wait_until(lambda: state(client, source).generation_idle_s > 0, "the loop idle with nothing to do")
            st = state(client, source)
            assert st.generation_busy_s > 0 and st.target_groups == 4
            assert "rollout_idle_ratio" in run.pull_stats and 0 <= run.pull_stats["rollout_idle_ratio"] <= 1
            text = httpx.get(f"{bench_service}/metrics", timeout=30).text
            assert f'farm_queue_generation_idle_seconds{{source="{source}"}}' in text
            assert f'farm_queue_generation_busy_seconds{{source="{source}"}}' in text
        finally:
            client.queue_remove_source(source)


@pytest.mark.parametrize("policy", ["partial", "abort"])
def test_a_commit_while_the_queue_generates_reaches_the_batch_with_each_tokens_version(
    service, client, tiny_model, policy
):
    """Long generations (ignore_eos) for the trainer's source; once a replica decodes the first step's prompt, the
    trainer's push with `policy` (what the async trainer pushes with). The first step's batch: with "partial" every
    token before the commit is on the old version and every one after on the new, the sample's staleness 1 (its
    oldest token); with "abort" the samples were run again on the new weights: one version, staleness 0. The next
    step, after one more push (bucketed: against the first, which the pusher remembers), gets nothing past s=1."""
    source = f"async-commit-{policy}"
    wait_until(lambda: not any(r["busy"] for r in replicas(service)), "replicas idle before the test")
    params = {"temperature": 1.0, "max_new_tokens": LONG_TOKENS, "ignore_eos": True}
    spec = {"name": source, "n": 2, "sampling_params": params, "target_groups": 2}
    assert httpx.post(f"{service}/v1/queue/sources", json=spec, headers=AUTH, timeout=30).status_code == 200
    run = trainer_stub(client, source, 1, batch=1, steps=2)
    old = run.version
    try:
        t, out = in_thread(lambda: pull_step(run))
        wait_until(lambda: any(r["busy"] for r in replicas(service)), "a replica decoding the fed prompts")
        model = AutoModelForCausalLM.from_pretrained(tiny_model)
        model.load_state_dict(perturbed(tiny_model, seed=5, scale=0.1))
        pusher = WeightPusher(client, "bucketed")
        assert push_weights(pusher, model, policy) == old + 1 and pusher.last["mode"] == "full"  # nothing to diff
        run.version = old + 1  # the trainer's version once its push returned
        t.join(300)
        assert out and not isinstance(out[0], Exception), out
        b = make_batch(out[0], pad_id=0)
        lags = staleness_metrics.sample_staleness(b, run.version).tolist()
        rows = [v[m.bool()].tolist() for v, m in zip(b.token_versions, b.response_mask)]
        assert all(len(r) == LONG_TOKENS for r in rows)
        if policy == "partial":
            assert lags == [1, 1] and all(r[0] == old and r[-1] == old + 1 and r == sorted(r) for r in rows), lags
            assert staleness_metrics.staleness_metrics(b, run.version)["spanning_samples"] == 2
        else:
            assert lags == [0, 0] and all(set(r) == {old + 1} for r in rows), lags
            assert all(s.token_weight_versions is None for g in out[0] for s in g.samples)
        run.version = old + 2
        with torch.no_grad():
            model.model.norm.weight.add_(0.01)
        assert push_weights(pusher, model, policy) == old + 2
        assert pusher.last["mode"] == "bucketed" and pusher.last["sent_tensors"] == 1
        second = make_batch(pull_step(run), pad_id=0)
        assert staleness_metrics.sample_staleness(second, run.version).max() <= 1
    finally:
        client.queue_remove_source(source)
