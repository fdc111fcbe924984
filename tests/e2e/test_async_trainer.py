"""The async trainer (async_training.staleness_threshold=1) against the real service: what each step trains on.

Generations are long (ignore_eos, set on the trainer's queue source before it starts) and each push waits until a
replica is decoding (at most a minute, no assertion on it), so the commit lands while the queue generates the next
step's groups: the trainer's own loop, batches and metrics.jsonl must then show
  - no step's sample older than 1 version (its oldest token), per the batch the trainer built and per its metrics;
  - with partial_rollout=true: samples spanning two versions, each token's version in the batch, the spanning
    samples counted, the late samples' importance weights logged;
  - with partial_rollout=false (pushes with "abort"): no sample spans versions: cut samples ran again.
"""

import json
import time

import httpx
import pytest

from rollout_farm.trainer.config import load
from rollout_farm.trainer.outputs import staleness_metrics
from rollout_farm.trainer.sync import rollouts
from tests.conftest import TOKEN
from tests.service.helpers import AUTH, replicas

TOKENS = 1024


def config(service, tiny_model, tmp_path, source, *overrides):
    return load(
        None,
        [
            f"trainer.service_url={service}",
            f"actor_rollout_ref.model.path={tiny_model}",
            "trainer.task=arith",
            "trainer.total_training_steps=3",
            "data.train_batch_size=1",
            "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.actor.ppo_mini_batch_size=1",
            "actor_rollout_ref.actor.optim.lr=0.01",
            f"trainer.default_local_dir={tmp_path}",
            "trainer.reward=test_float_ties",
            "trainer.rollout_source=queue",
            f"trainer.queue_source={source}",
            "async_training.staleness_threshold=1",
            *overrides,
        ],
    )


def wait_decoding(run, service, source: str, limit_s: float = 60.0) -> None:
    """Until a replica decodes, or the source has nothing left to generate (at most limit_s)."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline and not any(r["busy"] for r in replicas(service)):
        state = next(s for s in run.client.queue_sources() if s.name == source)
        if not state.generating and not state.pending_prompts:
            return
        time.sleep(0.05)


@pytest.mark.parametrize("partial", [True, False])
def test_the_async_trainer_trains_within_the_bound_on_samples_that_span_versions(
    service, tiny_model, tmp_path, monkeypatch, partial
):
    from rollout_farm.trainer.loop import train
    from rollout_farm.trainer.run import TrainingRun

    source = f"e2e-async-{partial}"
    params = {"temperature": 1.0, "max_new_tokens": TOKENS, "ignore_eos": True}
    spec = {"name": source, "n": 2, "sampling_params": params, "target_groups": 2, "reward": "test_float_ties"}
    assert httpx.post(f"{service}/v1/queue/sources", json=spec, headers=AUTH, timeout=30).status_code == 200
    seen = []  # (the trainer's version, the batch) of each step
    pull = rollouts.pull

    def spy(run):
        batch = pull(run)
        seen.append((run.version, batch))
        return batch

    monkeypatch.setattr(rollouts, "pull", spy)
    try:
        cfg = config(service, tiny_model, tmp_path, source, f"async_training.partial_rollout={partial}")
        run = TrainingRun(cfg, TOKEN)
        push = run.push
        run.push = lambda: (wait_decoding(run, service, source), push())
        train(run)
    finally:
        httpx.delete(f"{service}/v1/queue/sources/{source}", headers=AUTH, timeout=30)
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2, 3] and len(seen) == 3
    for (version, b), step in zip(seen, steps):
        lags = staleness_metrics.sample_staleness(b, version)
        assert 0 <= lags.min() and lags.max() <= 1 and step["staleness_max"] == lags.max()
        assert step["staleness_hist"] == staleness_metrics.staleness_metrics(b, version)["staleness_hist"]
        for row, mask, first in zip(b.token_versions, b.response_mask, b.weight_versions):
            versions = row[mask.bool()].tolist()
            assert versions[0] == first and versions == sorted(versions) and versions[-1] <= version
            assert partial or len(set(versions)) == 1  # abort: cut samples ran again on one version
    # the metric counts exactly the samples whose tokens span versions; under "abort" there are none. Whether a
    # partial commit lands mid-sample here depends on the machine's speed: test_async_training.py's
    # test_a_commit_while_the_queue_generates_reaches_the_batch_with_each_tokens_version forces one
    spanned = sum(
        len(set(row[mask.bool()].tolist())) > 1 for _, b in seen for row, mask in zip(b.token_versions, b.response_mask)
    )
    assert sum(s["spanning_samples"] for s in steps) == spanned and (partial or spanned == 0), spanned
    late = [s for s in steps if s["offpolicy_fraction"] > 0]
    assert all(s["offpolicy_is_weight_mean"] is not None and "offpolicy_clipped_fraction" in s for s in late)
    assert all("trainer_idle_ratio" in s and "push_seconds" in s for s in steps)
    assert all("rollout_idle_ratio" in s for s in steps[1:])  # from the second pull on: busy/idle since the last
