"""Async training without a service: the config, feeding ahead and leasing against a fake queue client, the
per-token versions in the batch, the staleness and off-policy correction figures, the push policy, the gauges."""

import math
import random
import types

import pytest
import torch

from rollout_farm.services import protocol as P
from rollout_farm.trainer.algorithms import rollout_correction
from rollout_farm.trainer.batch import make_batch
from rollout_farm.trainer.config import ConfigError, RolloutCorrection, load
from rollout_farm.trainer.outputs import staleness_metrics, step_metrics
from rollout_farm.trainer.sync import rollouts, staleness_bound

QUEUE = ["trainer.rollout_source=queue"]


def sample(version: int, tokens: list[int] | None = None, n: int = 3, behaviour: float = -1.0) -> P.Sample:
    return P.Sample(
        token_ids=[5] * n,
        logprobs=[-1.0] * n,
        sampling_logprobs=[behaviour] * n,
        text="x",
        finish_reason="length",
        weight_version=version,
        token_weight_versions=tokens,
    )


def group(*samples: P.Sample) -> P.Group:
    return P.Group(prompt_token_ids=[1, 2], samples=list(samples), reward_mean=0, reward_std=0, zero_variance=True)


def test_the_config_takes_verls_and_areals_names_and_refuses_what_cannot_hold_the_bound():
    c = load(None, [*QUEUE, "async_training.staleness_threshold=2"])
    assert c.async_training.staleness_threshold == 2 and c.async_training.partial_rollout
    alias = load(None, [*QUEUE, "async_training.max_head_offpolicyness=1"])
    assert alias.async_training.staleness_threshold == 1
    assert not load(None, []).async_training.enabled  # synchronous by default
    with pytest.raises(ConfigError, match="set trainer.rollout_source=queue"):
        load(None, ["async_training.staleness_threshold=1"])
    with pytest.raises(ConfigError, match="old_logprobs=recompute"):
        load(None, [*QUEUE, "async_training.staleness_threshold=1", "actor_rollout_ref.actor.old_logprobs=rollout"])
    with pytest.raises(ConfigError, match="leave queue_max_staleness at 0"):
        load(None, [*QUEUE, "async_training.staleness_threshold=1", "trainer.queue_max_staleness=3"])


class FakeQueue:
    """A queue client: sources, prompt batches (once per batch_id) and pulls that hand out scripted groups."""

    def __init__(self, pulls: list[P.PullResponse] | None = None):
        self.sources: dict[str, P.QueueSource] = {}
        self.batches: list[tuple[str, int]] = []
        self.pulls, self.requests, self.busy, self.idle = list(pulls or []), [], 0.0, 0.0

    def queue_sources(self):
        return [self.state(name) for name in self.sources]

    def state(self, name):
        target = self.sources[name].target_groups
        return P.QueueSourceState(
            name=name,
            dataset=None,
            pending_prompts=0,
            ready=0,
            leased=0,
            acked=0,
            redelivered=0,
            stale_dropped=0,
            generating=False,
            target_groups=target,
            generation_busy_s=self.busy,
            generation_idle_s=self.idle,
        )

    def queue_add_source(self, spec):
        self.sources[spec.name] = spec
        return self.state(spec.name)

    def queue_add_prompts(self, name, prompts, batch_id=None):
        self.batches.append((batch_id, len(prompts)))

    def queue_pull(self, req):
        self.requests.append(req)
        if self.pulls:
            return self.pulls.pop(0)
        items = [item(f"i{len(self.requests)}-{j}", group(sample(9))) for j in range(req.max_groups)]
        return P.PullResponse(lease_id="l", lease_expires_s=1, current_version=9, items=items)


def item(item_id: str, g: P.Group) -> P.QueueItem:
    prompt = P.Prompt(text="q")
    return P.QueueItem(item_id=item_id, prompt=prompt, group=g, weight_version=0, deliveries=1)


def test_a_lease_refuses_groups_whose_oldest_token_is_past_the_bound_and_counts_the_services_drops():
    spans = group(sample(7, [7, 8, 8]))  # a partial sample: its first token is 2 versions behind 9
    fresh = group(sample(8), sample(9))
    first = P.PullResponse(
        lease_id="a",
        lease_expires_s=1,
        current_version=9,
        items=[item("old", spans), item("ok", fresh)],
        stale_dropped=3,
    )
    q = FakeQueue([first])
    got = staleness_bound.lease(q, "src", 2, version=9, bound=1, lease_s=5)
    assert [i.item_id for i in got.items] == ["ok", "i2-0"] and got.refused == 1 and got.stale_dropped == 3
    assert [r.max_staleness for r in q.requests] == [1, 1] and [r.max_groups for r in q.requests] == [2, 1]
    loose = staleness_bound.lease(FakeQueue([first]), "src", 2, version=9, bound=None, lease_s=5)
    assert [i.item_id for i in loose.items] == ["old", "ok"] and loose.refused == 0  # no bound: the old one arrives


def fake_run(q: FakeQueue, s: int, steps: int = 5, batch: int = 2):
    cfg = load(None, [*QUEUE, f"async_training.staleness_threshold={s}", f"data.train_batch_size={batch}"])
    cfg.trainer.total_training_steps = steps
    task = types.SimpleNamespace(
        train_batch=lambda rng, k: [types.SimpleNamespace(prompt=f"p{rng.random()}", answer="1") for _ in range(k)],
        reward="gsm8k",
        max_new_tokens=8,
    )
    return types.SimpleNamespace(
        cfg=cfg,
        client=q,
        rng=random.Random(0),
        tok=types.SimpleNamespace(chat_template=None),
        task=task,
        pulls=0,
        batches=0,
        run_id="r",
        version=9,
        pull_stats={},
        queue_clock=None,
        leased=[],
        redelivered=0,
        generated_tokens=0,
    )


@pytest.mark.parametrize("s", [0, 1, 2])
def test_the_trainer_feeds_s_steps_ahead_never_past_the_last_and_each_batch_once(s):
    q = FakeQueue()
    run = fake_run(q, s, steps=5)
    fed = []
    for _ in range(5):
        run.pulls += 1
        groups = rollouts.lease_groups(run)
        fed.append(len(q.batches))
        assert len(groups) == 2 and len(run.leased) == 2
        q.busy, q.idle = q.busy + 3.0, q.idle + 1.0
    assert fed == [min(k + s, 5) for k in range(1, 6)]
    assert [b for b, _ in q.batches] == [f"r:{i}" for i in range(1, 6)]
    assert next(iter(q.sources.values())).target_groups == (s + 1) * 2
    assert run.pull_stats["rollout_idle_ratio"] == pytest.approx(0.25)  # 1 s idle of 4 since the previous pull
    assert all(r.max_staleness == s for r in q.requests)


def test_the_batch_keeps_each_tokens_version_and_the_staleness_counts_the_oldest():
    b = make_batch([group(sample(3), sample(3, [3, 4, 4]), sample(5, n=2))], pad_id=0)
    assert b.token_versions.tolist() == [[3, 3, 3], [3, 4, 4], [5, 5, 0]]
    assert b.oldest_versions.tolist() == [3, 3, 5]
    assert b.select(torch.tensor([1])).token_versions.tolist() == [[3, 4, 4]]
    m = staleness_metrics.staleness_metrics(b, version=5)
    assert m["staleness_hist"] == [1, 0, 2] and m["staleness_max"] == 2 and m["spanning_samples"] == 1
    assert m["token_staleness_mean"] == pytest.approx((2 + 2 + 2 + 2 + 1 + 1 + 0 + 0) / 8)
    assert m["offpolicy_fraction"] == pytest.approx(2 / 3)


@pytest.mark.parametrize("threshold, clipped, masked", [(2.0, 1.0, 0.0), ("0.5_2.0", 0.0, 1.0), (5.0, 0.0, 0.0)])
def test_the_off_policy_figures_say_what_the_correction_did_to_the_stale_samples(threshold, clipped, masked):
    # the late samples (lag 2) were drawn with logprob -1.2 where the trainer's policy gives -0.2: ratio e = 2.72
    b = make_batch([group(sample(3, behaviour=-1.2), sample(5, behaviour=-0.2))], pad_id=0)
    cfg = RolloutCorrection(rollout_is_threshold=threshold)
    old = torch.full((2, 3), -0.2)
    weights, mask, _ = rollout_correction.correction(old, b, cfg)
    m = staleness_metrics.offpolicy_correction(b, 5, old, weights, mask, cfg)
    assert m["offpolicy_clipped_fraction"] == clipped and m["offpolicy_masked_fraction"] == masked
    expected = {2.0: 2.0, "0.5_2.0": 0.0, 5.0: math.e}[threshold]
    assert m["offpolicy_is_weight_mean"] == pytest.approx(expected, rel=1e-5)
    on_policy = staleness_metrics.offpolicy_correction(b, 3, old, weights, mask, cfg)  # nothing is late at version 3
    assert on_policy["offpolicy_is_weight_mean"] is None


def test_async_gauges_are_set_by_the_steps_that_have_them_and_the_histogram_counts_samples():
    before = step_metrics.STALENESS._sum.get()
    step_metrics.record(None, {"trainer_idle_ratio": 0.25, "offpolicy_is_weight_mean": None, "staleness_hist": [1, 2]})
    gauges = step_metrics.STEP_GAUGES
    assert gauges["trainer_idle_ratio"]._value.get() == 0.25 and math.isnan(
        gauges["offpolicy_is_weight_mean"]._value.get()
    )
    assert step_metrics.STALENESS._sum.get() - before == 2  # two samples of lag 1
    step_metrics.record(None, {"step": 3})  # a step without them leaves them as they were
    assert gauges["trainer_idle_ratio"]._value.get() == 0.25
    assert step_metrics.pull_metrics({"rollout_wait_s": 1.0}, 4.0)["trainer_idle_ratio"] == 0.25


def unreported(temperature: float, top_p: float = 1.0, top_k: int = -1, regex: bool = False) -> P.Sample:
    """A sample from an engine that reports no sampling logprobs (SGLang; or a regex-constrained one whose q the
    torch engine could not pin down), drawn with these params."""
    return P.Sample(
        token_ids=[5, 5],
        logprobs=[-1.0, -1.0],
        text="x",
        finish_reason="length",
        weight_version=9,  # the current version: a sync run takes them as they are
        sampled_with=P.SampledWith(temperature=temperature, top_p=top_p, top_k=top_k, regex=regex),
    )


@pytest.mark.parametrize(
    "params, known",
    [((1.0,), True), ((0.7,), False), ((1.0, 0.9), False), ((1.0, 1.0, 20), False), ((1.0, 1.0, -1, True), False)],
)
def test_raw_logprobs_stand_for_q_only_when_the_sampling_did_not_change_the_distribution(params, known):
    b = make_batch([group(unreported(*params))], pad_id=0)
    assert b.sampling_known.tolist() == [int(known)]


@pytest.mark.parametrize("s, params, refused", [(1, (0.7,), True), (1, (1.0,), False), (0, (0.7,), False)])
def test_async_training_refuses_samples_it_cannot_correct(s, params, refused):
    """Async training needs each sample's q for its staleness correction: from the engine, or equal to the raw
    logprobs. Without either, every weight would silently be 1 (the negative controls: raw sampling, or sync)."""
    items = [item(f"i{j}", group(unreported(*params), unreported(*params))) for j in range(2)]
    q = FakeQueue([P.PullResponse(lease_id="l", lease_expires_s=1, current_version=9, items=items)])
    run = fake_run(q, s)
    run.pad_id = 0
    if refused:
        with pytest.raises(RuntimeError, match="top_p 1 and top_k -1"):
            rollouts.pull(run)
    else:
        assert len(rollouts.pull(run)) == 4


def test_a_spanning_sample_is_weighted_with_each_tokens_own_q():
    """A partial sample (drawn by versions 7, 8, 8) whose tokens were drawn with different q: token-level truncated
    IS weighs each token by its own ratio. A mutant that gives every token the first token's q weighs all three 2.0
    (the async tests above use one q for every token, so they cannot tell)."""
    drawn = [-1.2, -0.4, -0.9]
    s = sample(7, [7, 8, 8]).model_copy(update={"sampling_logprobs": drawn})
    b = make_batch([group(s)], pad_id=0)
    assert b.sampling_logprobs[0].tolist() == pytest.approx(drawn)
    old = torch.full((1, 3), -0.5)
    weights, _, _ = rollout_correction.correction(
        old, b, RolloutCorrection(rollout_is="token", rollout_is_threshold=2.0)
    )
    expected = [min(2.0, math.exp(-0.5 - q)) for q in drawn]  # 2.0 (capped), 0.905, 1.49
    assert weights[0].tolist() == pytest.approx(expected, rel=1e-5)
