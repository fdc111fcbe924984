"""Episode groups as rollout groups (rollout_farm/services/protocol/episode_groups.py), and the trainer's batch of
them: the observations between turns are context (loss mask 0), the reward lands on the last sampled token."""

import pytest
import torch

from rollout_farm.services import protocol as P
from rollout_farm.services.protocol import episodes as E
from rollout_farm.services.protocol import sessions as S
from rollout_farm.services.protocol.episode_groups import as_group
from rollout_farm.trainer.algorithms.losses import outcome_to_token_rewards
from rollout_farm.trainer.batch import make_batch

PARAMS = P.SamplingParams(temperature=1.0, max_new_tokens=4)


def episode(opening, turns, observations, reward, stop="done", version=3) -> E.EpisodeOut:
    """A head segment: the opening, then each turn's sampled ids, with an observation's ids after all but the last."""
    ids, mask, spans = list(opening), [0] * len(opening), []
    for k, turn in enumerate(turns):
        spans.append(S.TurnSpan(start=len(ids), end=len(ids) + len(turn), finish_reason="stop"))
        ids += turn
        mask += [1] * len(turn)
        if k < len(observations):
            ids += observations[k]
            mask += [0] * len(observations[k])
    seg = S.SegmentOut(
        segment_id="0",
        token_ids=ids,
        loss_mask=mask,
        logprobs=[-0.5 if m else 0.0 for m in mask],
        sampling_logprobs=[-0.4 if m else 0.0 for m in mask],
        token_versions=[version if m else -1 for m in mask],
        turns=spans,
    )
    return E.EpisodeOut(
        session_id="s",
        segments=[seg],
        reward=reward,
        turn_rewards=[0.0] * (len(turns) - 1) + [reward],
        turns=len(turns),
        tool_calls=0,
        malformed_tool_calls=0,
        stop_reason=stop,
        weight_version=version if turns else -1,
    )


def group(*episodes) -> E.EpisodeGroup:
    return E.EpisodeGroup(prompt_index=2, episodes=list(episodes), reward_mean=0, reward_std=0, zero_variance=False)


def test_an_episode_group_is_a_group_whose_samples_mask_the_observations():
    two_turns = episode([1, 2, 3], [[10, 11], [12]], [[20, 21, 22]], 1.0)
    one_turn = episode([1, 2, 3], [[13, 14, 15]], [], 0.0)
    g = as_group(group(two_turns, one_turn), PARAMS)
    assert g.prompt_token_ids == [1, 2, 3] and g.prompt_index == 2 and g.reward_mean == 0.5
    a, b = g.samples
    assert a.token_ids == [10, 11, 20, 21, 22, 12] and a.loss_mask == [1, 1, 0, 0, 0, 1]
    assert a.token_weight_versions == [3] * 6 and a.logprobs == [-0.5, -0.5, 0, 0, 0, -0.5]
    assert b.token_ids == [13, 14, 15] and b.loss_mask == [1, 1, 1] and g.generated_tokens == 6


def test_failed_and_empty_episodes():
    failed = episode([1, 2], [[10]], [[20]], 0.0, stop="env_error")
    nothing = episode([1, 2], [], [], 0.0, stop="env_error")
    g = as_group(group(failed, nothing), PARAMS)
    (s,) = g.samples  # the episode that sampled nothing is left out
    assert s.finish_reason == "error" and set(s.loss_mask) == {0}
    assert as_group(group(nothing), PARAMS) is None
    with pytest.raises(ValueError, match="share no opening"):
        as_group(group(episode([1], [[10]], [], 0.0), episode([2], [[10]], [], 0.0)), PARAMS)


def test_the_batch_trains_the_sampled_tokens_and_rewards_the_last_one():
    g = as_group(group(episode([1, 2, 3], [[10, 11], [12]], [[20, 21, 22]], 1.0)), PARAMS)
    b = make_batch([g], pad_id=0)
    assert b.response_mask[0].tolist() == [1, 1, 0, 0, 0, 1]
    rewards = outcome_to_token_rewards(b.rewards, b.response_mask)
    assert rewards[0].tolist() == [0, 0, 0, 0, 0, 1.0]  # on the last sampled token
    # negative control: the single-turn rule (the count of masked tokens, minus one) lands inside the observation
    wrong = int(b.response_mask[0].sum()) - 1
    assert b.response_mask[0, wrong] == 0
    # a sample without a loss mask trains every token, as before
    single = P.Group(
        prompt_token_ids=[1],
        samples=[g.samples[0].model_copy(update={"loss_mask": None})],
        reward_mean=1,
        reward_std=0,
        zero_variance=True,
    )
    assert bool(make_batch([single], pad_id=0).response_mask.all()) and torch.equal(
        outcome_to_token_rewards(b.rewards, torch.ones(1, 6))[0], torch.tensor([0, 0, 0, 0, 0, 1.0])
    )


def spanning(opening, turns, observations, versions, reward=1.0) -> E.EpisodeOut:
    """An episode whose turn k was sampled on weights versions[k] (commits landed between its turns)."""
    ep = episode(opening, turns, observations, reward, version=min(versions))
    seg = ep.segments[0]
    for t, v in zip(seg.turns, versions):
        seg.token_versions[t.start : t.end] = [v] * (t.end - t.start)
    return ep


def test_the_batch_keeps_a_prompts_episodes_in_one_group():
    """Wiring: make_batch gives the episodes of one prompt (one episode group) one group id, so GRPO compares them
    with each other only.

    Mutation killed (seen failing): in make_batch, `group_ids=torch.arange(B)` (a group per sample)."""
    a = as_group(group(episode([1, 2], [[10]], [], 1.0), episode([1, 2], [[11]], [], 0.0)), PARAMS)
    b = as_group(group(episode([3], [[12]], [], 1.0), episode([3], [[13]], [], 1.0)), PARAMS)
    batch = make_batch([a, b], pad_id=0)
    assert batch.group_ids.tolist() == [0, 0, 1, 1]


def test_an_episode_spanning_versions_keeps_each_tokens_version_and_its_groups_oldest_is_the_oldest():
    """Wiring: an episode whose turns were sampled on versions 4 then 6 reaches the batch with per-token versions
    (4 on the first turn, 6 on the second), weight_version 4; its group's oldest version is the oldest token's.

    Mutations killed (seen failing): in episode_groups.as_sample, `token_weight_versions=None` (every token the
    episode's oldest); in Group.oldest_version, each sample's `max` of its token versions instead of `min`."""
    g = as_group(group(spanning([1, 2], [[10, 11], [12]], [[20]], [4, 6]), spanning([1, 2], [[13]], [], [5])), PARAMS)
    assert g.oldest_version() == 4
    b = make_batch([g], pad_id=0)
    assert b.token_versions[0].tolist() == [4, 4, 4, 6] and b.weight_versions.tolist() == [4, 5]
    assert b.oldest_versions.tolist() == [4, 5]


def observation_batch() -> tuple:
    """Two samples of 5 response tokens: the first has an observation (loss mask 0) at positions 2-3 between its
    turns, the second is single-turn and 2 tokens long. A bigram policy and reference (V 4)."""
    from tests.unit.batches import response_batch
    from tests.unit.enumeration import Bigram

    g = torch.Generator().manual_seed(5)
    mask = torch.tensor([[1, 1, 0, 0, 1], [1, 1, 0, 0, 0]])
    ids = torch.tensor([[1, 2, 3, 0, 2], [3, 1, 0, 0, 0]])
    b = response_batch(mask, ids, group_ids=torch.tensor([0, 0]))
    table = torch.randn(4, 4, generator=g)
    return b, Bigram(table + torch.randn(4, 4, generator=g)), Bigram(table)


def test_observation_tokens_stay_out_of_the_kl_reading():
    """Wiring: the trainer's KL reading (loop.kl_readings) is a mean over the sampled tokens only: an observation
    whose KL is large does not move it.

    Mutation killed (seen failing): in loop.kl_readings, `mask = torch.ones_like(b.response_mask)`."""
    from rollout_farm.trainer.algorithms.forward import policy_and_reference
    from rollout_farm.trainer.loop import kl_readings

    b, policy, ref = observation_batch()
    with torch.no_grad():
        old, ref_lp, kl, _ = policy_and_reference(policy, ref, b, b.temperatures)
    kl = kl + 100.0 * (1 - b.response_mask)  # what an observation's KL would add if it were read
    sampled = b.response_mask.bool()
    readings = kl_readings(b, old, ref_lp, kl)
    assert readings["kl_ref_before"] == pytest.approx(kl[sampled].mean().item(), rel=1e-6)
    k1 = (old - ref_lp)[sampled].mean().item()
    assert readings["kl_k1"] == pytest.approx(k1, rel=1e-5, abs=1e-7)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_observation_tokens_stay_out_of_the_entropy_and_the_length_normalisation(mode):
    """Wiring: the actor's step (actor.update_actor over minibatches.mini_batches) takes the entropy and the
    policy-gradient loss over the sampled tokens only, and normalises by their count: an observation's advantage
    (any value) changes nothing, and the losses equal the means over the sampled tokens computed here by hand.

    Mutations killed (seen failing): in actor._backward, the entropy aggregated over `torch.ones_like(mask)`; in
    minibatches.mini_batches, `tokens = torch.ones_like(b.response_mask[whole]).sum(-1)` (every response position
    counted in the token-mean's normaliser)."""
    from rollout_farm.trainer.actor import ActorInputs, update_actor
    from rollout_farm.trainer.algorithms.forward import response_logprobs
    from rollout_farm.trainer.config import load
    from rollout_farm.trainer.minibatches import mini_batches

    b, policy, _ = observation_batch()
    cfg = load(None, [f"actor_rollout_ref.actor.loss_agg_mode={mode}", "actor_rollout_ref.actor.grad_clip=1e9"])
    a = cfg.actor_rollout_ref.actor
    with torch.no_grad():
        lp, entropy = response_logprobs(policy, b, b.temperatures, with_entropy=True)
    adv = torch.tensor([[1.0, -2.0, 50.0, 50.0, 3.0], [0.5, 1.5, 0.0, 0.0, 0.0]])
    opt = torch.optim.SGD(policy.parameters(), lr=0.0)
    (mb,) = list(mini_batches(b, 1))
    row = update_actor(ActorInputs(policy, b, adv, lp, lp, b.response_mask.float(), a), opt, mb)
    m = b.response_mask.bool()
    if mode == "token-mean":
        want_ent, want_pg = entropy[m].mean(), -adv[m].mean()  # ratio 1: the loss is -advantage
    else:
        want_ent = torch.stack([entropy[i][m[i]].mean() for i in range(2)]).mean()
        want_pg = torch.stack([-adv[i][m[i]].mean() for i in range(2)]).mean()
    assert row["entropy"] == pytest.approx(want_ent.item(), rel=1e-5)
    assert row["pg_loss"] == pytest.approx(want_pg.item(), rel=1e-5)
