"""Episode groups as rollout groups, so that a trainer learns from episodes as it does from single-turn samples (the
queue's episode sources and `farm train data.env=...` use it).

The one function in the protocol layer, and a pure one: it reads one wire model (`EpisodeGroup`) into another
(`Group`), with no I/O and no state. It lives here, beside the models, because both sides need it: the service's
episode sources (rollout_farm/services/episodes/episodes.py) and the trainer (rollout_farm/trainer/sync/rollouts.py),
which may import only the service's base modules.

The group's prompt is what every episode of the group starts with (the environment's opening, up to the first
sampled token of the shortest); each sample is the rest of its episode's tokens: the sampled turns and, between
them, the observations and template tokens, which `loss_mask` marks 0 (their logprobs are 0, their versions the
episode's). Each turn keeps the params it was drawn with (`sampled_turns`: a sampler may change them between
turns), and the q of a turn the engine did not report stays unknown (the sample's sampling_logprobs None). Rewards
are the episodes' (advantages are per episode); an episode that ended in env_error keeps its tokens but trains none
of them (`loss_mask` all 0) and has finish_reason "error"; one that sampled nothing is left out.
"""

from __future__ import annotations

import statistics

from rollout_farm.services import protocol as P
from rollout_farm.services.protocol import episodes as E
from rollout_farm.services.protocol.rollouts import SampledSpan

FINISH = {"done": "stop", "max_turns": "length", "max_tokens": "length", "context_overflow": "length"}


def as_group(group: E.EpisodeGroup, params: P.SamplingParams) -> P.Group | None:
    """None when no episode of the group sampled a token (every one failed at its reset)."""
    episodes = [ep for ep in group.episodes if ep.segments[-1].turns]  # episodes never fork: one segment each
    if not episodes:
        return None
    heads = [ep.segments[-1] for ep in episodes]
    cut = common_prefix([h.token_ids[: h.turns[0].start] for h in heads])
    if cut == 0:
        raise ValueError("the episodes of a group share no opening tokens: the environment's reset must not vary")
    samples = [as_sample(ep, h, cut, params) for ep, h in zip(episodes, heads)]
    rewards = [s.reward for s in samples]
    std = statistics.pstdev(rewards)
    return P.Group(
        prompt_token_ids=heads[0].token_ids[:cut],
        samples=samples,
        reward_mean=statistics.fmean(rewards),
        reward_std=std,
        zero_variance=std < 1e-6,
        prompt_index=group.prompt_index,
        generated_tokens=sum(sum(h.loss_mask) for h in heads),
    )


def as_sample(ep: E.EpisodeOut, head, cut: int, params: P.SamplingParams) -> P.Sample:
    """The episode's head segment after the group's opening. Each turn keeps the params it was drawn with
    (`sampled_turns`); its q is unknown for the whole sample (sampling_logprobs None, as for a single-turn sample
    whose engine reported none) when any turn's is."""
    oldest = ep.weight_version if ep.weight_version >= 0 else 0
    mask = head.loss_mask[cut:] if ep.stop_reason != "env_error" else [0] * (len(head.token_ids) - cut)
    asked = P.SampledWith(
        temperature=params.temperature, top_p=params.top_p, top_k=params.top_k, regex=params.regex is not None
    )
    turns = [
        SampledSpan(start=t.start - cut, end=t.end - cut, sampled_with=t.sampled_with or asked) for t in head.turns
    ]
    known = all(t.sampling_known and s.sampled_with.temperature > 0 for t, s in zip(head.turns, turns))
    return P.Sample(
        token_ids=head.token_ids[cut:],
        logprobs=head.logprobs[cut:],
        sampling_logprobs=head.sampling_logprobs[cut:] if known else None,
        sampled_with=turns[0].sampled_with,
        sampled_turns=turns,
        text="",
        finish_reason=FINISH.get(ep.stop_reason, "error"),
        reward=ep.reward,
        weight_version=oldest,
        token_weight_versions=[v if v >= 0 else oldest for v in head.token_versions[cut:]],
        sampler_meta={"session_id": ep.session_id, "turns": ep.turns, "tool_calls": ep.tool_calls},
        loss_mask=mask,
    )


def common_prefix(seqs: list[list[int]]) -> int:
    n = min(map(len, seqs))
    for i in range(n):
        if any(s[i] != seqs[0][i] for s in seqs):
            return i
    return n
