"""Sessions at the ingress: open, a turn at a time (token ids, or OpenAI chat with tools), reward, close, read the
trajectory.

A token turn (`generate`) appends the client's ids to the head segment, samples one completion of the whole segment
through the rollout path (the same checks, fan-out and engines as POST /v1/rollouts), and appends the sampled ids as
the engine returned them. `offset` rewrites: the head forks at that token and the turn goes on in the new segment.
`turn` names the turn; a repeat of an answered turn with the same ids is a retry and gets the stored answer.

A chat turn (`chat`) does the same from OpenAI messages: a history the head already answered is a retry; one that
extends the head's renders only its new messages (in the ingress, with the replicas' tokenizer:
rollout_farm/services/chat/renderer.py); any other forks the head at the last message both share. The sampled text's
tool calls are read by the session's tool format.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from rollout_farm.services import protocol as P
from rollout_farm.services.chat.delta import NotAppendOnly
from rollout_farm.services.chat.tool_formats import AUTO, TOOL_FORMATS, ParsedTurn
from rollout_farm.services.episodes import chat_turns
from rollout_farm.services.episodes.chat_turns import invalid
from rollout_farm.services.episodes.history_match import match
from rollout_farm.services.episodes.segments import Segment, shared_messages
from rollout_farm.services.episodes.session_store import Session, SessionStore
from rollout_farm.services.errors import Conflict, Invalid, NotFound
from rollout_farm.services.observability import metrics
from rollout_farm.services.protocol import sessions as S
from rollout_farm.services.tenants.registry import ADMIN, ANYONE, Principal

if TYPE_CHECKING:
    from rollout_farm.services.chat.renderer import ChatRenderer

Answer = Callable[[P.RolloutRequest], Awaitable[P.RolloutResponse]]  # the rollout path (Rollouts.answer)
HELD_TAIL = 64  # the last ids of a segment a chat turn is rendered after, to tell which closing tokens it has


class Sessions:
    def __init__(self, answer: Answer, renderer: ChatRenderer, store: SessionStore, model: str):
        self.answer, self.renderer, self.store, self.model = answer, renderer, store, model

    async def open(self, req: S.SessionCreate, base_url: str, who: Principal = ANYONE) -> S.SessionInfo:
        """A new session, owned by `who`'s tenant (the caller may use req.adapter: the route checks)."""
        if req.tool_format not in [AUTO, *TOOL_FORMATS.names()]:
            names = ", ".join([AUTO, *TOOL_FORMATS.names()])
            raise invalid("tool_format", f"unknown tool format {req.tool_format!r}: one of {names}")
        tool_format = await self.renderer.tool_format() if req.tool_format == AUTO else req.tool_format
        metrics.TOOL_CALLS.labels(tool_format)  # a series at 0 from the start: a parser that never reads shows
        metrics.TOOL_PARSE_ERRORS.labels(tool_format)
        session = Session(
            id=uuid.uuid4().hex,
            tool_format=tool_format,
            sampling_params=req.sampling_params.model_dump(),
            min_weight_version=req.min_weight_version,
            ttl_s=req.ttl_s,
            group_id=req.group_id,
            malformed_tool_calls=req.malformed_tool_calls,
            sampler=req.sampler.model_dump(),
            segments=[Segment("0")],
            owner=who.tenant,
            adapter=req.adapter.model_dump(exclude_none=True) if req.adapter else None,
        )
        await self.store.create(session)
        return info(session, base_url)

    async def sample(
        self, session: Session, tokens: list[int], params: P.SamplingParams, fields: dict[str, str] | None = None
    ) -> P.Sample:
        """One completion of the session's tokens, through the rollout path; its 422s name the route's `fields`
        (a rollout's field -> the caller's) where given."""
        rollout = P.RolloutRequest(
            prompts=[P.Prompt(token_ids=tokens)],
            n=1,
            sampling_params=params,
            sampler=P.SamplerSpec(**session.sampler),
            min_weight_version=session.min_weight_version,
            routing_key=session.id,  # its home replica, and the KV cache kept there between turns
            adapter=P.AdapterRef(**session.adapter) if session.adapter else None,
        )
        try:
            return (await self.answer(rollout)).groups[0].samples[0]
        except Invalid as e:
            if not fields:
                raise
            raise chat_turns.renamed(e, fields) from None

    async def chat(
        self, session_id: str, req: S.SessionChatRequest, context: int | None = None, who: Principal = ADMIN
    ) -> dict:
        """An OpenAI chat turn on the session's tokens (see the module's docstring). With `context` (the model's, for
        episodes run in the farm) the turn's max tokens shrink to what still fits, and ContextFull when none does."""
        tools, forced = chat_turns.checked_tools(req)
        messages = [m.as_chat() for m in req.messages]
        async with self.store.locked(session_id):
            session = await self.open_session(session_id, who, whole=False)
            fmt = TOOL_FORMATS.get(session.tool_format)()
            for i, segment in enumerate(session.segments):
                if not segment.from_token_ids and (turn := segment.answered(messages)) is not None:  # a retry
                    whole = await self.load(session_id, who)  # its logprobs and versions (a turn loads its own only)
                    return await self.completion(whole, whole.segments[i], segment.turns.index(turn), req)
            head = self.chat_head(session, messages)
            new = messages[match(head.messages, messages).given :]  # a harness may have merged stored messages
            if not new or new[-1]["role"] == "assistant":
                raise invalid("messages", "the last message is the assistant's: end with the one the model answers")
            opening = fmt.opening(forced) if forced else ""
            tail, after_assistant = head.token_ids[-HELD_TAIL:], head.ends_with_assistant()
            try:
                answered = head.messages[-1].get("tool_calls") if head.messages else None
                ids = await self.renderer.turn(tail, after_assistant, new, tools, not head.messages, opening, answered)
            except NotAppendOnly as e:
                metrics.TOKEN_MISMATCH.labels("template").inc()
                raise invalid("messages", f"no exact token continuation: {e}") from None
            close, rendered, prompt, opened = ids
            head.add_context(close, [])
            head.add_context(rendered, new)
            head.add_context(prompt + opened, [])
            if not head.token_ids:
                raise invalid("messages", "they render to no tokens through the model's chat template: give some text")
            params = chat_turns.turn_params(session.sampling_params, req)
            if context is not None:
                params = chat_turns.fitted(params, context - len(head.token_ids))
            sample = await self.sample(session, head.token_ids, params, chat_turns.rollout_fields(req))
            written, tokenizer = opened + sample.token_ids, await self.renderer.loaded()  # markers read by id
            thinking = not opened and chat_turns.opens_thinking(tokenizer, prompt)
            parsed = chat_turns.parsed_turn(fmt, "", len(head.turns), req.tool_choice, written, tokenizer, thinking)
            append_sample(head, sample, parsed, not (parsed.malformed and session.malformed_tool_calls == "mask"))
            metrics.SESSION_TURNS.labels("chat").inc()
            metrics.TOOL_CALLS.labels(fmt.name).inc(len(parsed.calls))
            metrics.TOOL_PARSE_ERRORS.labels(fmt.name).inc(len(parsed.malformed))
            await self.store.save(session)
            return await self.completion(session, head, len(head.turns) - 1, req)

    def chat_head(self, session: Session, messages: list[dict]) -> Segment:
        """The segment a chat history goes on in: the head when it extends it, else a fork of the segment sharing
        the most messages with it (the latest on a tie), cut at the last shared message. A head built from token ids
        alone has no messages to match: 409."""
        head = session.head
        if head.from_token_ids or (head.token_ids and not head.messages):
            metrics.TOKEN_MISMATCH.labels("token_session").inc()
            raise Conflict(f"session {session.id} was built from token ids: go on with its /generate")
        m = match(head.messages, messages)
        if not head.messages or (m.stored == len(head.messages) and m.given < len(messages)):  # head.extended_by
            for rule in sorted(m.rules):  # what it took to see the same history
                metrics.SESSION_NORMALISED.labels(rule).inc()
            return head
        parent = max(reversed(session.segments), key=lambda s: shared_messages(s.messages, messages))
        session.segments.append(parent.fork(str(len(session.segments)), messages))
        metrics.SESSION_FORKS.labels("messages").inc()
        return session.head

    async def completion(self, session: Session, segment: Segment, index: int, req: S.SessionChatRequest) -> dict:
        turn = segment.turns[index]
        pieces = None
        if req.logprobs:
            pieces = (await self.renderer.token_pieces([segment.token_ids[turn.start : turn.end]]))[0]
        return chat_turns.completion(session, segment, index, self.model, pieces, bool(req.return_token_ids))

    async def load(self, session_id: str, who: Principal = ADMIN, whole: bool = True) -> Session:
        """The session, when `who` may use it: another tenant's is unknown to it (404, as for no such session).
        whole=False: as a turn needs it (the store's load: masks, logprobs and versions only from their end on)."""
        session = await self.store.load(session_id, whole)
        if not who.may_use(session.owner):
            raise NotFound(f"no session {session_id}: open one with POST /v1/sessions")
        return session

    async def open_session(self, session_id: str, who: Principal = ADMIN, whole: bool = True) -> Session:
        session = await self.load(session_id, who, whole)
        if session.closed:
            raise Conflict(f"session {session_id} is closed: open another")
        return session

    async def info(self, session_id: str, base_url: str, who: Principal = ADMIN) -> S.SessionInfo:
        return info(await self.load(session_id, who), base_url)

    async def generate(self, session_id: str, req: S.SessionGenerate, who: Principal = ADMIN) -> S.SessionTurn:
        async with self.store.locked(session_id):
            session = await self.open_session(session_id, who, whole=False)
            if (answered := retried(session.head, req)) is not None:
                return turn_answer(await self.load(session_id, who), answered)
            return await self.token_turn(session, req)

    async def tokens_turn(
        self, session_id: str, prompt: list[int], params: P.SamplingParams, who: Principal = ADMIN
    ) -> S.SessionTurn:
        """A token turn from the whole prompt, as a vLLM client sends it (POST {base_url}/inference/v1/generate): the
        prompt of a turn the head answered gets that turn again; else what follows the head's tokens is appended, or
        the head forks where the prompt leaves its tokens and the rest goes on in the new segment."""
        async with self.store.locked(session_id):
            session = await self.open_session(session_id, who, whole=False)
            head = session.head
            for index, t in enumerate(head.turns):
                if t.start == len(prompt) and head.token_ids[: t.start] == prompt:
                    return turn_answer(await self.load(session_id, who), index)
            shared = common_prefix(head.token_ids, prompt)
            offset = None if shared == len(head.token_ids) else shared
            return await self.token_turn(
                session, S.SessionGenerate(append_token_ids=prompt[shared:], offset=offset), params
            )

    async def token_turn(
        self, session: Session, req: S.SessionGenerate, params: P.SamplingParams | None = None
    ) -> S.SessionTurn:
        """Append the ids (in a fork at `offset` if given), sample one completion of the segment, append it verbatim."""
        head = rewritten(session, req)
        tokens = head.token_ids + req.append_token_ids
        if not tokens:
            raise invalid("append_token_ids", "the session holds no tokens yet: send the prompt's ids")
        params = params or req.sampling_params or P.SamplingParams(**session.sampling_params)
        sample = await self.sample(session, tokens, params)
        head.add_context(req.append_token_ids, [])
        head.from_token_ids = True  # its messages no longer say its tokens: a chat turn on it is a 409
        append_sample(head, sample, ParsedTurn(sample.text))
        metrics.SESSION_TURNS.labels("generate").inc()
        await self.store.save(session)
        return turn_answer(session, len(head.turns) - 1)

    async def reward(
        self, session_id: str, req: S.SessionReward, base_url: str, who: Principal = ADMIN
    ) -> S.SessionInfo:
        async with self.store.locked(session_id):
            session = await self.load(session_id, who, whole=False)
            if req.turn is None:
                session.reward = req.reward
            elif req.turn < len(session.head.turns):
                session.head.turns[req.turn].reward = req.reward
            else:
                raise invalid("turn", f"the head segment has {len(session.head.turns)} turns: give one of them")
            await self.store.save(session)
            return info(session, base_url)

    async def close(self, session_id: str, base_url: str, who: Principal = ADMIN) -> S.SessionInfo:
        async with self.store.locked(session_id):
            session = await self.load(session_id, who, whole=False)
            session.closed = True
            await self.store.save(session)
            return info(session, base_url)

    async def trajectory(self, session_id: str, who: Principal = ADMIN) -> S.Trajectory:
        session = await self.load(session_id, who)
        return S.Trajectory(
            session_id=session.id,
            group_id=session.group_id,
            closed=session.closed,
            reward=session.reward,
            segments=[segment_out(s) for s in session.segments],
        )

    async def list(self) -> S.SessionList:
        return S.SessionList(sessions=await self.store.ids())

    async def delete(self, session_id: str) -> dict:
        return {"session_id": session_id, "deleted": await self.store.delete(session_id)}


def append_sample(head: Segment, sample: P.Sample, parsed: ParsedTurn, trained: bool = True) -> None:
    """The sampled ids verbatim, with their logprobs and versions, the params they were drawn with, and the assistant
    message they read as. Their q is what the engine reported, else the raw logprobs where those are q (temperature
    1, no top-p, top-k or regex), else unknown: 0.0 and `sampling_known` False, never taken for q (as for a
    rollout's sample, rollout_farm/trainer/batch.py `sampling_q_known`)."""
    n = len(sample.token_ids)
    with_ = sample.sampled_with
    q = sample.sampling_logprobs
    if q is None and with_ is not None and with_.raw_is_q():
        q = sample.logprobs
    head.add_sampled(
        sample.token_ids,
        sample.logprobs,
        q if q is not None else [0.0] * n,
        sample.token_weight_versions or [sample.weight_version] * n,
        sample.finish_reason,
        chat_turns.assistant_message(parsed),
        parsed.calls,
        parsed.malformed,
        trained,
        sampled_with=with_.model_dump() if with_ is not None else None,
        sampling_known=q is not None,
        policies=[p.model_dump() for p in sample.policies or [sample.policy] if p is not None] or None,
    )


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading ids the two share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def retried(head: Segment, req: S.SessionGenerate) -> int | None:
    """The turn a request repeats (same turn index, same ids after the same tokens), None for a new turn; 409 for an
    answered turn with other ids, 422 for a turn past the next one."""
    if req.turn is None or req.turn == len(head.turns):
        return None
    if req.turn > len(head.turns):
        raise invalid("turn", f"the next turn of this session is {len(head.turns)}")
    start = head.turns[req.turn - 1].end if req.turn else head.parent_tokens
    sent = head.token_ids[start : head.turns[req.turn].start]
    if req.offset not in (None, start) or req.append_token_ids != sent:
        metrics.TOKEN_MISMATCH.labels("retry_conflict").inc()
        raise Conflict(
            f"turn {req.turn} was generated already from other tokens: to rewrite it, send offset={start} "
            "(a new segment)"
        )
    return req.turn


def rewritten(session: Session, req: S.SessionGenerate) -> Segment:
    """The segment this turn extends: the head, or a fork of it at `offset`."""
    head = session.head
    if req.offset is None or req.offset == len(head.token_ids):
        return head
    if req.offset > len(head.token_ids):
        raise invalid("offset", f"the session holds {len(head.token_ids)} tokens: give an offset up to that")
    session.segments.append(head.fork_at(str(len(session.segments)), req.offset))
    metrics.SESSION_FORKS.labels("offset").inc()
    return session.head


def turn_answer(session: Session, index: int) -> S.SessionTurn:
    head, t = session.head, session.head.turns[index]
    return S.SessionTurn(
        session_id=session.id,
        segment_id=head.id,
        turn=index,
        prompt_tokens=t.start,
        token_ids=head.token_ids[t.start : t.end],
        logprobs=head.logprobs[t.start : t.end],
        sampling_logprobs=head.sampling_logprobs[t.start : t.end] if t.sampling_known else None,
        sampled_with=t.sampled_with,
        finish_reason=t.finish_reason,
        weight_version=min(head.token_versions[t.start : t.end], default=-1),
        token_weight_versions=head.token_versions[t.start : t.end],
        policies=t.policies,
    )


def segment_out(s: Segment) -> S.SegmentOut:
    return S.SegmentOut(
        segment_id=s.id,
        parent=s.parent,
        parent_tokens=s.parent_tokens,
        token_ids=s.token_ids,
        loss_mask=s.loss_mask,
        logprobs=s.logprobs,
        sampling_logprobs=s.sampling_logprobs,
        token_versions=s.token_versions,
        turns=[
            S.TurnSpan(
                start=t.start,
                end=t.end,
                finish_reason=t.finish_reason,
                reward=t.reward,
                sampled_with=t.sampled_with,
                sampling_known=t.sampling_known,
                policies=t.policies,
            )
            for t in s.turns
        ],
    )


def info(session: Session, base_url: str) -> S.SessionInfo:
    return S.SessionInfo(
        session_id=session.id,
        base_url=f"{base_url.rstrip('/')}/v1/sessions/{session.id}",
        group_id=session.group_id,
        tool_format=session.tool_format,
        turns=len(session.head.turns),
        tokens=len(session.head.token_ids),
        segments=len(session.segments),
        closed=session.closed,
    )
