"""Each step's rollouts from the service, as a Batch (rank 0 only).

The step's prompts (the task's training problems, through the model's chat template) are either requested
(`trainer.rollout_source=request`: POST /v1/rollouts with the step's sampling seed and the configured sampler;
with `data.env`, POST /v1/episodes: each group n multi-turn episodes, as groups whose samples carry a loss mask)
or fed to the trainer's queue source and leased from it (`queue`; with `data.env` an episode source); leased groups
are acked once the step's weights are pushed, so a group leased by a trainer that died comes back when its lease
runs out.

With `async_training.staleness_threshold` s > 0 the trainer keeps s steps of prompts fed ahead of the one it pulls,
so the service generates them while it trains (rollout_farm/trainer/sync/staleness_bound.py); no group whose oldest
token is more than s versions behind the trainer is trained on.

With LoRA (rollout_farm/trainer/sync/adapter.py) every request names the adapter: a rollout the version just pushed
(exact, as min_weight_version names the base version today), the queue source its newest resident version (a floor
at the version pushed when the source was added). Every sample's policy digest is checked against what the trainer
pushed, and its weight version becomes its adapter version: versions, staleness and the off-policy correction then
count adapter versions, since the base never moves.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from functools import partial
from typing import TYPE_CHECKING

from rollout_farm.services import protocol as P
from rollout_farm.services.extensions.tasks import Problem
from rollout_farm.services.protocol import episodes as E
from rollout_farm.services.protocol.episode_groups import as_group
from rollout_farm.trainer.algorithms import stale_samples
from rollout_farm.trainer.batch import Batch, make_batch
from rollout_farm.trainer.sync import staleness_bound

if TYPE_CHECKING:
    from rollout_farm.trainer.run import TrainingRun

log = logging.getLogger("farm.trainer")


def render_prompt(tok, p: Problem) -> str:
    """The prompt text sent to the service: through the chat template when the model has one."""
    if tok.chat_template:
        return tok.apply_chat_template(
            [{"role": "user", "content": p.prompt}], tokenize=False, add_generation_prompt=True
        )
    return p.prompt


def pull(run: TrainingRun) -> Batch | None:
    """This step's rollouts; None when every group came back empty (filtered out by the sampler). The seconds it
    waited and what the queue dropped go to run.pull_stats."""
    start, run.pull_stats = time.perf_counter(), {}
    run.pulls += 1
    groups = lease_groups(run) if run.cfg.trainer.rollout_source == "queue" else request_groups(run, draw_prompts(run))
    if run.cfg.lora and run.cfg.trainer.rollout_source != "queue":  # the queue's are checked as they are leased
        groups = run.adapter.verified_all(groups, run.version)
    run.pull_stats["rollout_wait_s"] = time.perf_counter() - start
    groups = [g for g in groups if g.samples]
    if not groups:
        return None
    stale_samples.refuse_truncated(run.cfg, groups, run.version)
    batch = make_batch(groups, run.pad_id)
    stale = [v for v in batch.weight_versions.tolist() if v != run.version]
    unknown = int((batch.sampling_known == 0).sum())
    if unknown and (run.cfg.async_training.staleness_threshold or run.cfg.trainer.queue_max_staleness):
        raise RuntimeError(
            f"{unknown} samples came without the logprobs they were drawn with (the engine reports none, e.g. SGLang) "
            "and with a temperature, top_p or top_k that makes their raw logprobs differ: async training cannot "
            "correct them for staleness. Sample at temperature 1, top_p 1 and top_k -1, use an engine that reports "
            "sampling_logprobs (FARM_ENGINE=torch), or set async_training.staleness_threshold and "
            "trainer.queue_max_staleness to 0"
        )
    if stale and run.cfg.actor_rollout_ref.actor.old_logprobs == "rollout":
        raise RuntimeError(
            f"{len(stale)} samples came from weight versions {sorted(set(stale))}, expected {run.version}: "
            "set actor_rollout_ref.actor.old_logprobs=recompute to train on them with the rollout correction"
        )
    return batch


def draw_prompts(run: TrainingRun) -> list[P.Prompt]:
    """One step's prompts, drawn from the run's RNG (as text for an environment, which renders its own messages)."""
    d = run.cfg.data
    problems = run.task.train_batch(run.rng, math.ceil(d.train_batch_size * d.oversample))
    text = (lambda p: p.prompt) if d.env else (lambda p: render_prompt(run.tok, p))
    return [P.Prompt(text=text(p), ground_truth=p.answer) for p in problems]


def episode_limits(run: TrainingRun) -> E.EpisodeLimits | None:
    """The environment of `data.env`, its params and turns; None for single-turn rollouts."""
    d = run.cfg.data
    return E.EpisodeLimits(env=E.EnvSpec(name=d.env, params=d.env_params), max_turns=d.max_turns) if d.env else None


def max_new_tokens(run: TrainingRun) -> int:
    """The response length limit: data.max_response_length, or the task's."""
    return run.cfg.data.max_response_length or run.task.max_new_tokens


def adapter_ref(run: TrainingRun) -> P.AdapterRef | None:
    """With LoRA, the adapter version the trainer pushed last (exact); None: the base model."""
    return run.adapter.ref(run.version) if run.cfg.lora else None


def min_weight_version(run: TrainingRun) -> int:
    """The base version requests wait for: the trainer's version; with LoRA, the base version it started on (the
    adapter names the trainer's version)."""
    return run.base_version if run.cfg.lora else run.version


def sampling(run: TrainingRun) -> tuple[P.SamplingParams, P.SamplerSpec]:
    """The step's sampling params (a fresh seed from the run's RNG) and the configured sampler."""
    r = run.cfg.actor_rollout_ref.rollout
    params = P.SamplingParams(
        temperature=r.temperature, top_p=r.top_p, seed=run.rng.getrandbits(31), max_new_tokens=max_new_tokens(run)
    )
    return params, P.SamplerSpec(name=r.sampler, params=dict(r.sampler_params))


def request_groups(run: TrainingRun, prompts: list[P.Prompt]) -> list[P.Group]:
    """POST /v1/rollouts: n samples of each prompt from the weights the trainer holds."""
    d, t = run.cfg.data, run.cfg.trainer
    params, sampler = sampling(run)
    if sampler.name == "dynamic_group_filter" and len(prompts) > d.train_batch_size:
        sampler.params.setdefault("target_groups", d.train_batch_size)
    n = run.cfg.actor_rollout_ref.rollout.n
    if (limits := episode_limits(run)) is not None:
        common = {"prompts": prompts, "n": n, "sampling_params": params, "sampler": sampler}
        req = E.EpisodeRequest(**limits.model_dump(), **common, min_weight_version=min_weight_version(run))
        groups = [as_group(g, params) for g in run.client.episodes(req).groups]
        groups = [g for g in groups if g is not None]
        run.generated_tokens += sum(g.generated_tokens or 0 for g in groups)
        return groups
    req = P.RolloutRequest(
        prompts=prompts,
        n=n,
        sampling_params=params,
        sampler=sampler,
        reward=t.reward or run.task.reward,
        min_weight_version=min_weight_version(run),
        adapter=adapter_ref(run),
    )
    out = run.client.rollouts(req)
    run.generated_tokens += (
        out.filter.generated_tokens if out.filter else sum(g.generated_tokens or 0 for g in out.groups)
    )
    return out.groups


def lease_groups(run: TrainingRun) -> list[P.Group]:
    """Feed the trainer's queue source (this step's prompts, and with async training the next s steps' too) and
    lease train_batch_size groups from it; `ack` settles them after the step. A group leased by a trainer that died
    comes back once its lease runs out."""
    t, a = run.cfg.trainer, run.cfg.async_training
    name = source_name(run)
    state = next((s for s in run.client.queue_sources() if s.name == name), None)
    if state is None:
        state = add_queue_source(run, name)
    run.pull_stats |= staleness_bound.rollout_idle(run.queue_clock, state)
    run.queue_clock = (state.generation_busy_s, state.generation_idle_s)
    upto = min(run.pulls + a.staleness_threshold, t.total_training_steps) if a.enabled else run.pulls
    while run.batches < upto:  # each batch once, even if resumed: its id is the run's and its number
        run.batches += 1
        run.client.queue_add_prompts(name, draw_prompts(run), batch_id=f"{run.run_id}:{run.batches}")
    bound = a.staleness_threshold if a.enabled else t.queue_max_staleness
    verify = refused = None
    if run.cfg.lora:  # the service's pull check counts base versions, which LoRA training never moves
        verify, refused = run.adapter.verified, partial(requeue, run, name)
    got = staleness_bound.lease(
        run.client,
        name,
        run.cfg.data.train_batch_size,
        run.version,
        bound,
        t.queue_lease_s,
        verify=verify,
        requeue=refused,
    )
    run.pull_stats |= {"stale_dropped_groups": got.stale_dropped, "refused_groups": got.refused}
    run.leased = [i.item_id for i in got.items]
    run.redelivered += sum(i.deliveries > 1 for i in got.items)
    run.generated_tokens += sum(i.group.generated_tokens or 0 for i in got.items)
    return [i.group for i in got.items]


def requeue(run: TrainingRun, name: str, items: list[P.QueueItem]) -> None:
    """Settle refused queue groups and feed their prompts again, to be generated on the newest adapter version."""
    run.client.queue_ack([i.item_id for i in items])
    again = hashlib.sha256(items[0].item_id.encode()).hexdigest()[:16]  # a batch_id: at most 128 characters
    run.client.queue_add_prompts(name, [i.prompt for i in items], batch_id=f"{run.run_id}:again:{again}")


def source_name(run: TrainingRun) -> str:
    t = run.cfg.trainer
    if t.queue_source:
        return t.queue_source
    return f"farm-trainer-{run.cfg.adapter_name}" if run.cfg.lora else f"farm-trainer-{t.task}-{t.seed}"


def add_queue_source(run: TrainingRun, name: str) -> P.QueueSourceState:
    """The trainer's queue source: the service generates its groups ahead, with the run's sampling params, up to
    the groups of the steps fed ahead and the current one."""
    t = run.cfg.trainer
    params, sampler = sampling(run)
    source = P.QueueSource(
        name=name,
        n=run.cfg.actor_rollout_ref.rollout.n,
        sampling_params=params.model_copy(update={"seed": None}),
        sampler=sampler,
        reward=t.reward or run.task.reward,
        target_groups=staleness_bound.target_groups(run.cfg),
        episodes=episode_limits(run),
        adapter=P.AdapterRef(name=run.adapter.name, min_version=run.version) if run.cfg.lora else None,
    )
    state = run.client.queue_add_source(source)
    log.info("queue_source_added", extra={"source": name})
    return state


def ack(run: TrainingRun) -> None:
    """Settle the step's leased queue groups: they are used, the queue may forget them. Called after the step's
    checkpoint (the checkpoint lists them too, and a resume from it acks them), so with a checkpoint every step
    (trainer.save_freq=1) each group is trained exactly once across kills; with sparser checkpoints the steps
    after the last one are trained again from new groups."""
    if run.leased:
        run.client.queue_ack(run.leased)
        run.leased = []
