"""A session's turns as the trainer reads them (rollout_farm/services/episodes/sessions.py, segments.py, and
rollout_farm/services/protocol/episode_groups.py into rollout_farm/trainer/batch.py): each turn's q and sampling
params kept as drawn, and the session routes' refusals.

The rollout path is a fake (`Engine`): it answers each turn with the params a sampler planned and with or without
sampling logprobs, as the torch engine and SGLang do; the store keeps each session as the JSON Redis would hold. The
chat renderer is a fake too (a token per character): the tests here are about what the session keeps, not
about the template (tests/unit/test_session_tokens.py and tests/service/test_session_chat.py are).
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest
import torch

from rollout_farm.services import protocol as P
from rollout_farm.services.episodes.environments import Environment, Step
from rollout_farm.services.episodes.episodes import Episodes
from rollout_farm.services.episodes.segments import shared_messages
from rollout_farm.services.episodes.session_store import Session
from rollout_farm.services.episodes.sessions import Sessions
from rollout_farm.services.errors import Conflict, Invalid
from rollout_farm.services.protocol import episodes as E
from rollout_farm.services.protocol import sessions as S
from rollout_farm.services.protocol.episode_groups import as_group
from rollout_farm.services.rollout.request_checks import RequestChecks
from rollout_farm.trainer.algorithms.forward import temperatures
from rollout_farm.trainer.batch import make_batch
from rollout_farm.trainer.config import load

RAW = -0.5  # every sampled token's raw logprob
Q = -0.25  # and its sampling logprob, when the engine reports one


class Store:
    """SessionStore's interface in memory, each session kept as its JSON (what Redis holds)."""

    def __init__(self):
        self.data: dict[str, str] = {}

    async def create(self, session: Session) -> None:
        self.data[session.id] = session.to_json()

    async def load(self, session_id: str, whole: bool = True) -> Session:
        return Session.from_json(self.data[session_id])

    async def save(self, session: Session) -> None:
        self.data[session.id] = session.to_json()

    @contextlib.asynccontextmanager
    async def locked(self, session_id: str):
        yield


class Renderer:
    """A chat template's stand-in: a new message renders to a token per character of its content (at least one),
    the generation prompt to one more."""

    async def turn(self, tail, after_assistant, new, tools, first, opening, answered=None):
        return [[], [60 + ord(c) % 100 for m in new for c in (m.get("content") or "-")], [7], []]

    async def tool_format(self):
        return "hermes"

    async def loaded(self):
        return Decoder()


class Decoder:
    """The stand-in's tokenizer: every sample the Engine below draws reads "done", and no tag is a single token."""

    def encode(self, text, add_special_tokens=False):
        return [0, 0]

    def decode(self, ids, skip_special_tokens=True):
        return "done" if ids else ""


class Engine:
    """The rollout path: turn k is drawn with plans[k] (a sampler's SampledWith), its sampling logprobs reported when
    `reports_q` (the torch engine) and not (SGLang), as group_sampling.to_sample sets them; `context`: a model
    context the prompt must fit in, checked by the rollout path's own check."""

    def __init__(self, plans: list[P.SampledWith], reports_q: bool = True, context: int | None = None):
        self.plans, self.reports_q, self.context, self.asked = plans, reports_q, context, []

    async def read(self, what: str):  # the replicas, for RequestChecks
        return self.context

    async def __call__(self, req: P.RolloutRequest) -> P.RolloutResponse:
        if self.context is not None:
            await RequestChecks(self, None).fits(req.prompts, req.sampling_params.max_new_tokens)
        turn = sum(r.routing_key == req.routing_key for r in self.asked)  # the session's turn
        plan = self.plans[min(turn, len(self.plans) - 1)]
        self.asked.append(req)
        n, greedy = 2, plan.temperature == 0
        sample = P.Sample(
            token_ids=[30 + len(self.asked), 31],
            logprobs=[RAW] * n,
            sampling_logprobs=[Q] * n if self.reports_q and not greedy else None,
            sampled_with=plan,
            text="done",
            finish_reason="stop",
            weight_version=len(self.asked),
        )
        group = P.Group(prompt_token_ids=[], samples=[sample], reward_mean=0, reward_std=0, zero_variance=True)
        return P.RolloutResponse(groups=[group])


def drawn(temperature: float = 1.0, top_p: float = 1.0, regex: bool = False) -> P.SampledWith:
    return P.SampledWith(temperature=temperature, top_p=top_p, top_k=-1, regex=regex)


def sessions(engine: Engine) -> Sessions:
    return Sessions(engine, Renderer(), Store(), "policy")


def run(coro):
    return asyncio.run(coro)


async def token_episode(s: Sessions, turns: int, group_id: str = "g") -> E.EpisodeOut:
    """A session of `turns` token turns (a prompt, then an observation before each next turn), as an episode."""
    sid = (await s.open(S.SessionCreate(group_id=group_id), "")).session_id
    for k in range(turns):
        await s.generate(sid, S.SessionGenerate(append_token_ids=[1, 2, 3] if k == 0 else [40, 41]))
    trajectory = await s.trajectory(sid)
    return E.EpisodeOut(
        session_id=sid,
        segments=trajectory.segments,
        reward=1.0,
        turn_rewards=[0.0] * (turns - 1) + [1.0],
        turns=turns,
        tool_calls=0,
        malformed_tool_calls=0,
        stop_reason="done",
        weight_version=min(v for v in trajectory.segments[-1].token_versions if v >= 0),
    )


def batch_of(s: Sessions, turns: int, params: P.SamplingParams):
    ep = run(token_episode(s, turns))
    group = as_group(
        E.EpisodeGroup(prompt_index=0, episodes=[ep], reward_mean=1, reward_std=0, zero_variance=True), params
    )
    return ep, group, make_batch([group], pad_id=0)


def test_a_turn_whose_engine_reports_no_q_stays_unknown_unless_its_raw_logprobs_are_q():
    """Item 1 of issue 36: on an engine without sampling logprobs (SGLang) an episode's q was stored as 0.0 and the
    batch took it as known (q = 1: the ratio pi/1, a sequence weight of prod pi_old, and the refusal of async training
    without q never fired). Now a tempered turn's q is unknown (sampling_known 0, as a single-turn sample's), and a
    raw one's (T 1, no top-p/top-k/regex) is its raw logprobs.

    Mutation killed (seen failing): in sessions.append_sample, store `sample.sampling_logprobs or [0.0] * n` with
    `sampling_known=True` (the old code)."""
    params = P.SamplingParams(temperature=0.7, max_new_tokens=4)
    ep, group, b = batch_of(sessions(Engine([drawn(0.7)], reports_q=False)), 2, params)
    assert [t.sampling_known for t in ep.segments[0].turns] == [False, False]
    assert group.samples[0].sampling_logprobs is None and b.sampling_known.tolist() == [0]
    # the same engine at temperature 1: the raw logprobs are q, and known
    _, group, b = batch_of(sessions(Engine([drawn(1.0)], reports_q=False)), 2, params)
    s = group.samples[0]
    assert b.sampling_known.tolist() == [1] and [q for q, m in zip(s.sampling_logprobs, s.loss_mask) if m] == [RAW] * 4
    # one turn without q makes the sample's unknown; a regex turn's raw logprobs are not q
    _, _, b = batch_of(sessions(Engine([drawn(1.0), drawn(1.0, regex=True)], reports_q=False)), 2, params)
    assert b.sampling_known.tolist() == [0]
    # an engine that reports q (the torch engine): known, as reported, whatever the params
    _, group, b = batch_of(sessions(Engine([drawn(0.7)])), 2, params)
    assert b.sampling_known.tolist() == [1] and b.sampling_logprobs[0][b.response_mask[0].bool()].tolist() == [Q] * 4
    # the session's own answer says unknown as a rollout does: None, not zeros
    s = sessions(Engine([drawn(0.7)], reports_q=False))
    sid = run(s.open(S.SessionCreate(), "")).session_id
    assert run(s.generate(sid, S.SessionGenerate(append_token_ids=[1]))).sampling_logprobs is None


def test_each_turn_keeps_the_params_its_sampler_planned_and_the_trainer_reads_each_tokens_temperature():
    """Item 2 of issue 36: a turn's sampled_with was dropped when it was appended and the trainer rebuilt it from the
    request's params, so a turn kl_adaptive_temperature drew at T 0.5, top_p 0.9 reached the batch at T 1.0. Now each
    turn keeps its params (segment Turn -> TurnSpan -> Sample.sampled_turns) and the trainer divides each token's
    logits by its own turn's temperature.

    Mutations killed (seen failing): in sessions.append_sample, `sampled_with=None`; in forward.temperatures,
    `return b.temperatures` (per sample)."""
    params = P.SamplingParams(temperature=1.0, max_new_tokens=4)  # the request's: the sampler changed them
    plans = [drawn(0.5, top_p=0.9), drawn(0.8)]
    ep, group, b = batch_of(sessions(Engine(plans)), 2, params)
    assert [t.sampled_with for t in ep.segments[0].turns] == plans
    s = group.samples[0]
    assert s.sampled_with == plans[0] and [t.sampled_with for t in s.sampled_turns] == plans
    assert s.loss_mask == [1, 1, 0, 0, 1, 1]
    actor = load(None, []).actor_rollout_ref.actor
    assert actor.logits_temperature == "sampled"
    per_token = temperatures(b, actor)
    assert per_token.shape == (1, 6) and per_token[0].tolist() == pytest.approx([0.5, 0.5, 0.5, 0.5, 0.8, 0.8])
    # a single-turn sample: every token at its sample's temperature, as before
    single = P.Group(
        prompt_token_ids=[1],
        samples=[s.model_copy(update={"sampled_turns": None, "loss_mask": None})],
        reward_mean=0,
        reward_std=0,
        zero_variance=True,
    )
    assert temperatures(make_batch([single], 0), actor)[0].tolist() == [0.5] * 6


def test_tempered_log_softmax_divides_each_token_by_its_own_temperature():
    """forward.tempered_log_softmax with (B, R) temperatures against a loop over the positions, and (B,) as before."""
    from rollout_farm.trainer.algorithms.forward import tempered_log_softmax

    g = torch.Generator().manual_seed(0)
    logits, t = torch.randn(2, 3, 5, generator=g), torch.tensor([[0.5, 0.5, 1.0], [0.7, 1.3, 2.0]])
    out = tempered_log_softmax(logits, t)
    for i in range(2):
        for j in range(3):
            assert torch.allclose(out[i, j], torch.log_softmax(logits[i, j] / t[i, j], -1))
    same = tempered_log_softmax(logits, torch.tensor([0.5, 0.7]))
    assert torch.equal(same, tempered_log_softmax(logits, torch.tensor([[0.5] * 3, [0.7] * 3])))


def chat(s: Sessions, sid: str, messages: list[dict], **extra) -> dict:
    req = S.SessionChatRequest(messages=messages, **extra)
    return run(s.chat(sid, req))


def called(args: str) -> dict:
    call = {"id": "c0", "type": "function", "function": {"name": "calculator", "arguments": args}}
    return {"role": "assistant", "content": None, "tool_calls": [call]}


def test_a_tool_call_whose_arguments_are_not_json_is_kept_as_sent():
    """Item 5 of issue 36: an assistant call whose `arguments` are not JSON (OpenAI's field is the text the model
    wrote, which may be anything) was a 500 (json.loads in segments.normal) on a session that had answered a turn.
    Now it is compared as text: the same text is the same message, other text another (a fork), JSON still compared
    parsed (key order and spaces aside).

    Mutation killed (seen failing): segments.arguments back to `json.dumps(json.loads(text or "{}"), ...)` without
    the except (a JSONDecodeError)."""
    assert shared_messages([called('{"a": 1, "b": 2}')], [called('{"b":2,"a":1}')]) == 1
    assert shared_messages([called("{not json")], [called("{not json")]) == 1
    assert shared_messages([called("{not json")], [called("{not json either")]) == 0
    s = sessions(Engine([drawn()]))
    sid = run(s.open(S.SessionCreate(), "")).session_id
    first = [{"role": "user", "content": "3*4?"}]
    answer = chat(s, sid, first)["choices"][0]["message"]
    history = first + [
        answer,
        {"role": "user", "content": "and?"},
        called("{oops"),
        {"role": "tool", "content": "?", "tool_call_id": "c0"},
    ]
    out = chat(s, sid, history)
    assert out["farm"]["segment_id"] == "0"  # it extends the head: the first turn is shared
    assert run(s.store.load(sid)).head.messages[3]["tool_calls"][0]["function"]["arguments"] == "{oops"
    assert chat(s, sid, history)["farm"] == out["farm"]  # a retry gets the same turn


def test_a_chat_turn_on_a_session_built_from_token_ids_is_a_409():
    """Item 6 of issue 36: a token turn records its assistant message, so the head had messages and a chat turn
    silently forked (200) where docs/api.md promises a 409.

    Mutation killed (seen failing): in Sessions.chat_head, the condition back to `head.token_ids and not
    head.messages`."""
    s = sessions(Engine([drawn()]))
    sid = run(s.open(S.SessionCreate(), "")).session_id
    run(s.generate(sid, S.SessionGenerate(append_token_ids=[1, 2])))
    with pytest.raises(Conflict, match="built from token ids"):
        chat(s, sid, [{"role": "user", "content": "hi"}])
    with pytest.raises(Conflict, match="built from token ids"):  # nor does its assistant message read as a retry
        chat(s, sid, [{"role": "assistant", "content": "done"}, {"role": "user", "content": "hi"}])
    assert len(run(s.store.load(sid)).segments) == 1


@pytest.mark.parametrize("limit", ["max_tokens", "max_completion_tokens"])
def test_a_context_overflow_on_a_chat_turn_names_the_chat_requests_fields(limit):
    """Item 7 of issue 36: the rollout path's check names `prompts.0` and `sampling_params.max_new_tokens`, which
    a chat request does not have. Now the chat route names `messages` and the max tokens field the caller used.

    Mutation killed (seen failing): in Sessions.chat, `self.sample(session, head.token_ids, params)` without the
    route's fields."""
    s = sessions(Engine([drawn()], context=40))
    sid = run(s.open(S.SessionCreate(), "")).session_id
    with pytest.raises(Invalid) as e:
        chat(s, sid, [{"role": "user", "content": "hi"}], **{limit: 64})
    (detail,) = e.value.detail
    assert detail["field"] == limit and "max_new_tokens" not in detail["message"] + e.value.message
    assert f"lower {limit} to at most" in detail["message"]
    with pytest.raises(Invalid) as e:  # a history that fills the context alone: messages
        chat(s, sid, [{"role": "user", "content": "x" * 60}], **{limit: 1})
    assert [d["field"] for d in e.value.detail] == ["messages"]


class TwoSteps(Environment):
    """Rewards 0.5 for its first turn, then 1.0 and done."""

    async def reset(self, prompt):
        return [{"role": "user", "content": prompt.text}]

    async def step(self, turn):
        self.steps = getattr(self, "steps", 0) + 1
        if self.steps == 1:
            return Step([{"role": "user", "content": "go on"}], reward=0.5)
        return Step(reward=1.0, done=True)


async def context_length():
    return None


def test_an_episodes_reward_is_the_sum_of_its_turns_and_each_turn_keeps_its_params():
    """Wiring, docs/episodes.md: an episode's reward is the sum of its steps' rewards (EpisodeOut.reward) and lands
    on its sample (the last sampled token), not the last turn's; with a sampler that changes T between turns, each
    turn reaches the batch at its own T through the whole episode runner.

    Mutation killed (seen failing): in episode_groups.as_sample, `reward=ep.turn_rewards[-1]`."""
    plans = [drawn(0.5, top_p=0.9), drawn(0.9)]
    episodes = Episodes(sessions(Engine(plans)), context_length, [__name__])
    params = P.SamplingParams(temperature=1.0, max_new_tokens=4)
    req = E.EpisodeRequest(
        env=E.EnvSpec(name=f"{__name__}:TwoSteps"), prompts=[P.Prompt(text="q")], n=2, sampling_params=params
    )
    (group,) = run(episodes.generate_for_queue(req))
    assert [s.reward for s in group.samples] == [1.5, 1.5]
    b = make_batch([group], 0)
    assert b.rewards.tolist() == [1.5, 1.5]
    for s, temps in zip(group.samples, b.token_temperatures):
        assert [t.sampled_with.temperature for t in s.sampled_turns] == [0.5, 0.9]
        first, second = s.sampled_turns
        assert temps[first.start : first.end].tolist() == [0.5] * (first.end - first.start)
        assert temps[second.start : second.end].tolist() == pytest.approx([0.9] * (second.end - second.start))


def test_a_sessions_tool_format_is_the_models_by_default_and_an_unknown_one_names_the_field_and_the_names():
    s = sessions(Engine([drawn()]))
    assert run(s.open(S.SessionCreate(), "")).tool_format == "hermes"  # "auto": what the renderer tells
    assert run(s.open(S.SessionCreate(tool_format="harmony"), "")).tool_format == "harmony"
    with pytest.raises(Invalid) as e:
        run(s.open(S.SessionCreate(tool_format="xml"), ""))
    assert e.value.detail[0]["field"] == "tool_format" and "auto, deepseek-v3" in e.value.detail[0]["message"]
