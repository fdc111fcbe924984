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
