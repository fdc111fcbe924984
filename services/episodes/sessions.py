"""Sessions at the ingress, token level: open, generate turn by turn, reward, close, read the trajectory.

A turn appends the client's ids to the head segment, samples one completion of the whole segment through the rollout
path (the same checks, fan-out and engines as POST /v1/rollouts), and appends the sampled ids as the engine returned
them. `offset` rewrites: the head forks at that token and the turn goes on in the new segment. `turn` names the turn;
a repeat of an answered turn with the same ids is a retry and gets the stored answer, never a second sample.
"""

from __future__ import annotations

import uuid

from services import protocol as P
from services.episodes.segments import Segment
from services.episodes.session_store import Session, SessionStore
from services.episodes.tool_formats import TOOL_FORMATS
from services.errors import Conflict, Invalid
from services.protocol import sessions as S
from services.rollout.rollouts import Rollouts


def invalid(field: str, message: str) -> Invalid:
    return Invalid([{"field": field, "message": message}])


class Sessions:
    def __init__(self, rollouts: Rollouts, store: SessionStore):
        self.rollouts, self.store = rollouts, store

    async def open(self, req: S.SessionCreate, base_url: str) -> S.SessionInfo:
        if req.tool_format not in TOOL_FORMATS.names():
            raise invalid("tool_format", f"unknown tool format {req.tool_format!r}: {', '.join(TOOL_FORMATS.names())}")
        session = Session(
            id=uuid.uuid4().hex,
            tool_format=req.tool_format,
            sampling_params=req.sampling_params.model_dump(),
            min_weight_version=req.min_weight_version,
            ttl_s=req.ttl_s,
            group_id=req.group_id,
            segments=[Segment("0")],
        )
        await self.store.create(session)
        return info(session, base_url)

    async def info(self, session_id: str, base_url: str) -> S.SessionInfo:
        return info(await self.store.load(session_id), base_url)

    async def generate(self, session_id: str, req: S.SessionGenerate) -> S.SessionTurn:
        async with self.store.locked(session_id):
            session = await self.store.load(session_id)
            if session.closed:
                raise Conflict(f"session {session_id} is closed: open another")
            if (answered := retried(session.head, req)) is not None:
                return turn_answer(session, answered)
            head = rewritten(session, req)
            tokens = head.token_ids + req.append_token_ids
            if not tokens:
                raise invalid("append_token_ids", "the session holds no tokens yet: send the prompt's ids")
            params = req.sampling_params or P.SamplingParams(**session.sampling_params)
            rollout = P.RolloutRequest(
                prompts=[P.Prompt(token_ids=tokens)],
                n=1,
                sampling_params=params,
                min_weight_version=session.min_weight_version,
            )
            sample = (await self.rollouts.answer(rollout)).groups[0].samples[0]
            head.add_context(req.append_token_ids, [])
            n = len(sample.token_ids)
            head.add_sampled(
                sample.token_ids,
                sample.logprobs,
                sample.sampling_logprobs or [0.0] * n,
                sample.token_weight_versions or [sample.weight_version] * n,
                sample.finish_reason,
                {"role": "assistant", "content": sample.text},
            )
            await self.store.save(session)
            return turn_answer(session, len(head.turns) - 1)

    async def reward(self, session_id: str, req: S.SessionReward, base_url: str) -> S.SessionInfo:
        async with self.store.locked(session_id):
            session = await self.store.load(session_id)
            if req.turn is None:
                session.reward = req.reward
            elif req.turn < len(session.head.turns):
                session.head.turns[req.turn].reward = req.reward
            else:
                raise invalid("turn", f"the head segment has {len(session.head.turns)} turns: give one of them")
            await self.store.save(session)
            return info(session, base_url)

    async def close(self, session_id: str, base_url: str) -> S.SessionInfo:
        async with self.store.locked(session_id):
            session = await self.store.load(session_id)
            session.closed = True
            await self.store.save(session)
            return info(session, base_url)

    async def trajectory(self, session_id: str) -> S.Trajectory:
        session = await self.store.load(session_id)
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
        sampling_logprobs=head.sampling_logprobs[t.start : t.end],
        finish_reason=t.finish_reason,
        weight_version=min(head.token_versions[t.start : t.end], default=-1),
        token_weight_versions=head.token_versions[t.start : t.end],
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
        turns=[S.TurnSpan(start=t.start, end=t.end, finish_reason=t.finish_reason, reward=t.reward) for t in s.turns],
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
