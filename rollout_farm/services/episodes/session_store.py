"""Sessions in Redis, stored append-only so that a turn costs what it adds, not what the session holds; a session
survives an ingress restart and every ingress replica serves it. A lock per session runs its turns one at a time (a
retry waits for the turn it repeats, then gets its answer).

Keys under `farm:<app>:sess:<id>`, all expiring together ttl_s after the session's last change:
  <id>                       the header, JSON: the settings, closed, reward, a revision, and per segment its parent,
                             parent_tokens and how many tokens, messages and turns it holds (the commit record)
  <id>:<seg>:<column>        token_ids, loss_mask, logprobs, sampling_logprobs, token_versions: packed numbers
                             (token_columns.py), a fork's own tokens only: its first parent_tokens are its parent's
  <id>:<seg>:messages        JSON lines, [message, end] each (a fork's start as a copy of the messages it shares)
  <id>:<seg>:turns           JSON lines, a turn record each
  <id>:<seg>:rewards         hash: turn index -> the reward set on it after it was stored
  <id>:lock                  the turn lock
A save writes, in one MULTI/EXEC, each value's new bytes at the offset the header commits, then the header (revision
+ 1) and the TTL of every key; it is refused when the header's revision is no longer the one loaded. A load reads up
to the header's offsets only, so bytes a writer left past them are never read, and refuses a session whose values
are shorter than its header says (a key evicted). Lines, not Redis lists: a list's entries cost the client a parse
each, one value one for all. A turn loads whole token ids (the engine samples from them), messages and turns (to
match a chat history), and of masks, logprobs and versions only what it adds (token_columns.Tail); a retry and the
trajectory load everything. A session stored before this layout (one JSON value) loads; its next save rewrites it.
"""

from __future__ import annotations

import contextlib
import json
import re
from dataclasses import asdict, dataclass, field, fields

from redis.asyncio import Redis
from redis.exceptions import LockError, WatchError

from rollout_farm.services.episodes.segments import Segment, Turn
from rollout_farm.services.episodes.token_columns import COLUMNS, SIZES, Tail, pack, unpack
from rollout_farm.services.errors import Conflict, NotFound
from rollout_farm.services.state.redis_client import binary

TURN_LOCK_S = 600  # a turn holds its session's lock at most this long (a lost holder's lock lapses)
SESSION_ID = re.compile(r"[0-9a-f]{32}")  # what Sessions.open gives (uuid4 hex)
LAYOUT = 2  # the header's "layout": append-only keys (none: the whole session as one JSON value)
LINES = ("messages", "turns")  # a segment's values of JSON lines; the header holds each one's count and bytes
PARTS = (*COLUMNS, *LINES, "rewards")
NOTHING = {"messages": 0, "messages_bytes": 0, "turns": 0, "turns_bytes": 0}  # a new segment's lines


@dataclass
class Held:
    """What Redis holds of a session, as its load or last save left it: the next save appends the rest."""

    rev: int = 0  # the header's revision: each save adds 1
    metas: dict[str, dict] = field(default_factory=dict)  # segment id -> its header entry
    rewards: dict[str, list[float | None]] = field(default_factory=dict)  # segment id -> each held turn's reward


@dataclass
class Session:
    id: str
    tool_format: str
    sampling_params: dict
    min_weight_version: int
    ttl_s: float
    group_id: str | None = None
    sampler: dict = field(default_factory=lambda: {"name": "plain", "params": {}})
    malformed_tool_calls: str = "train"  # or "mask": a turn whose call did not parse gets loss mask 0
    owner: str | None = None  # the tenant that opened it; None: the admin or nobody (rollout_farm/services/tenants/)
    adapter: dict | None = None  # the LoRA adapter its turns sample from (a P.AdapterRef's fields); None: the base
    closed: bool = False
    reward: float | None = None
    segments: list[Segment] = field(default_factory=list)
    held: Held = field(default_factory=Held, repr=False, compare=False)  # the store's bookkeeping, not the session's

    @property
    def head(self) -> Segment:
        return self.segments[-1]

    def settings(self) -> dict:
        """Its fields but the segments (and the store's bookkeeping): plain values."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("segments", "held")}

    def to_json(self) -> str:
        """The session as one JSON value (the layout before the append-only one; tests keep sessions in memory so)."""
        return json.dumps({**self.settings(), "segments": [s.to_json() for s in self.segments]}, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> Session:
        data = json.loads(text)
        return cls(**{**data, "segments": [Segment.from_json(s) for s in data["segments"]]})


class SessionStore:
    def __init__(self, r: Redis, prefix: str):
        self.r, self.raw, self.prefix = r, binary(r), f"{prefix}:sess:"

    def key(self, session_id: str) -> str:
        """The session's Redis key; 404 for an id no session can have (so no other key is ever read as a session)."""
        if not SESSION_ID.fullmatch(session_id):
            raise NotFound(f"no session {session_id[:80]!r}: session ids are what POST /v1/sessions answers")
        return self.prefix + session_id

    async def create(self, session: Session) -> None:
        """A new session's header (its segments hold nothing yet: the first save appends)."""
        assert not any(s.token_ids or s.messages or s.turns for s in session.segments), "a new session holds nothing"
        session.held = Held()
        if not await self.raw.set(
            self.key(session.id),
            header(session, 0, [entry(s, None) for s in session.segments]),
            ex=ttl(session),
            nx=True,
        ):
            raise Conflict(f"session {session.id} exists already")

    async def load(self, session_id: str, whole: bool = True) -> Session:
        """The session; with whole=False as a turn needs it: masks, logprobs and versions only from their end on."""
        key = self.key(session_id)
        text = await self.raw.get(key)
        if text is None:
            raise NotFound(
                f"no session {session_id!r}: it was never opened, or it expired (ttl_s after its last turn) or was "
                "deleted; open one with POST /v1/sessions"
            )
        data = json.loads(text)
        if data.get("layout") != LAYOUT:
            return Session.from_json(text)  # held nothing in this layout: its next save writes it all
        metas, rev = data.pop("segments"), data.pop("rev")
        del data["layout"]
        names = [*(COLUMNS if whole else ["token_ids"]), *LINES]
        reads = [(m, name) for m in metas for name in names if stored_bytes(m, name)]
        # the columns a turn does not read are measured: one lost (evicted, deleted) must not be refilled with zeros
        # by the next save's SETRANGE at its offset
        measured = [(m, name) for m in metas for name in COLUMNS if name not in names and stored_bytes(m, name)]
        async with self.raw.pipeline(transaction=True) as pipe:
            for m, name in reads:  # up to the header's offsets only
                pipe.getrange(part(key, m["id"], name), 0, stored_bytes(m, name) - 1)
            for m, name in measured:
                pipe.strlen(part(key, m["id"], name))
            for m in metas:
                pipe.hgetall(part(key, m["id"], "rewards"))
            replies = await pipe.execute()
        got = {(m["id"], name): value for (m, name), value in zip(reads, replies)}
        lengths = replies[len(reads) : len(reads) + len(measured)]
        for (m, name), length in zip(measured, lengths):
            if length < stored_bytes(m, name):
                raise incomplete(session_id, f"segment {m['id']}'s {name}")
        rewards = dict(zip([m["id"] for m in metas], replies[len(reads) + len(measured) :]))
        session = Session(**data)
        session.held = Held(rev)
        for m in metas:
            session.segments.append(segment(session, m, got, rewards[m["id"]], whole))
        return session

    async def save(self, session: Session) -> None:
        """What the session gained since its load, appended in one transaction, and every key's TTL renewed."""
        key, expire, held = self.key(session.id), ttl(session), session.held
        async with self.raw.pipeline(transaction=True) as pipe:
            await pipe.watch(key)
            text = await pipe.get(key)
            if text is None or revision(text) != held.rev:
                raise Conflict(
                    f"session {session.id} was deleted or changed while this turn ran (its lock lapses after "
                    f"{TURN_LOCK_S} s): the turn is not stored; read the session and go on from there"
                )
            pipe.multi()
            metas = [appended(pipe, key, seg, held) for seg in session.segments]
            pipe.set(key, header(session, held.rev + 1, metas), ex=expire)
            for seg in session.segments:
                for name in PARTS:
                    pipe.expire(part(key, seg.id, name), expire)
            try:
                await pipe.execute()
            except WatchError:
                raise Conflict(f"session {session.id} changed while this turn was stored: read it again") from None
        session.held = Held(
            held.rev + 1,
            {m["id"]: m for m in metas},
            {s.id: [t.reward for t in s.turns] for s in session.segments},
        )

    async def delete(self, session_id: str) -> bool:
        key = self.key(session_id)
        text = await self.raw.get(key)
        if text is None:
            return False
        data = json.loads(text)
        ids = [m["id"] for m in data["segments"]] if data.get("layout") == LAYOUT else []
        return bool(await self.raw.delete(key, *(part(key, i, name) for i in ids for name in PARTS)))

    async def ids(self) -> list[str]:
        keys = [k async for k in self.r.scan_iter(match=self.prefix + "[0-9a-f]" * 32, count=500)]
        return sorted(k[len(self.prefix) :] for k in keys)

    @contextlib.asynccontextmanager
    async def locked(self, session_id: str):
        """The session's turn lock, held while a turn changes it."""
        lock = self.r.lock(self.key(session_id) + ":lock", timeout=TURN_LOCK_S, sleep=0.02)
        await lock.acquire()
        try:
            yield
        finally:
            with contextlib.suppress(LockError):  # it lapsed: another turn may hold it now, nothing to release
                await lock.release()


def part(key: str, segment_id: str, name: str) -> str:
    return f"{key}:{segment_id}:{name}"


def ttl(session: Session) -> int:
    return int(session.ttl_s) or 1


def stored_bytes(meta: dict, name: str) -> int:
    """How many bytes of the segment's value the header commits (its own tokens' for a column)."""
    if name in LINES:
        return meta[f"{name}_bytes"]
    return (meta["tokens"] - meta["parent_tokens"]) * SIZES[name]


def header(session: Session, rev: int, metas: list[dict]) -> str:
    return json.dumps({"layout": LAYOUT, "rev": rev, **session.settings(), "segments": metas}, separators=(",", ":"))


def revision(text: bytes) -> int:
    data = json.loads(text)
    return data["rev"] if data.get("layout") == LAYOUT else 0


def appended(pipe, key: str, seg: Segment, held: Held) -> dict:
    """The segment's new tokens, messages and turns, and its held turns' changed rewards, onto the transaction; its
    header entry after them."""
    meta = entry(seg, held.metas.get(seg.id))
    tokens = meta["tokens"]
    if len(seg.token_ids) > tokens:
        for name in COLUMNS:
            pipe.setrange(part(key, seg.id, name), stored_bytes(meta, name), pack(name, getattr(seg, name)[tokens:]))
    n = meta["messages"]
    lines(pipe, key, seg.id, meta, "messages", zip(seg.messages[n:], seg.message_ends[n:]))
    rewards = held.rewards.get(seg.id, [])
    changed = {i: json.dumps(t.reward) for i, t in enumerate(seg.turns[: len(rewards)]) if t.reward != rewards[i]}
    if changed:
        pipe.hset(part(key, seg.id, "rewards"), mapping=changed)
    lines(pipe, key, seg.id, meta, "turns", (asdict(t) for t in seg.turns[meta["turns"] :]))
    meta["tokens"] = len(seg.token_ids)
    return meta


def entry(seg: Segment, held: dict | None) -> dict:
    """The segment's header entry, its counts as held (none held: a new segment, whose first parent_tokens tokens are
    its parent's)."""
    counts = held or {**NOTHING, "tokens": seg.parent_tokens}
    return {**counts, "id": seg.id, "parent": seg.parent, "parent_tokens": seg.parent_tokens,
            "from_token_ids": seg.from_token_ids}  # fmt: skip


def lines(pipe, key: str, segment_id: str, meta: dict, name: str, new) -> None:
    """New entries as JSON lines at the value's committed end (over any bytes a writer left past it); meta counts
    them."""
    text = "".join(json.dumps(entry, separators=(",", ":")) + "\n" for entry in new).encode()  # ASCII: bytes = chars
    if text:
        pipe.setrange(part(key, segment_id, name), meta[f"{name}_bytes"], text)
        meta[name] += text.count(b"\n")
        meta[f"{name}_bytes"] += len(text)


def parsed(data: bytes) -> list:
    """JSON lines, in one parse."""
    return json.loads(b"[" + data[:-1].replace(b"\n", b",") + b"]") if data else []


def segment(session: Session, meta: dict, got: dict, rewards: dict, whole: bool) -> Segment:
    """A segment from its header entry and what was read: its columns after its parent's first parent_tokens (mask 0
    there: trained in the parent); a column not read is a Tail of its length. A short value: 409."""
    seg_id, start = meta["id"], meta["parent_tokens"]
    parent = next((s for s in session.segments if s.id == meta["parent"]), None)
    seg = Segment(seg_id, meta["parent"], start, from_token_ids=meta["from_token_ids"])
    for name in COLUMNS:
        if not whole and name != "token_ids":
            setattr(seg, name, Tail(meta["tokens"]))
            continue
        own = got.get((seg_id, name), b"")
        if len(own) != stored_bytes(meta, name):
            raise incomplete(session.id, f"segment {seg_id}'s {name}")
        prefix = [0] * start if name == "loss_mask" else getattr(parent, name)[:start] if parent else []
        setattr(seg, name, prefix + unpack(name, own))
    for name in LINES:
        if len(got.get((seg_id, name), b"")) != stored_bytes(meta, name):
            raise incomplete(session.id, f"segment {seg_id}'s {name}")
    entries = parsed(got.get((seg_id, "messages"), b""))
    seg.messages, seg.message_ends = [m for m, _ in entries], [end for _, end in entries]
    seg.turns = [Turn.from_dict(t) for t in parsed(got.get((seg_id, "turns"), b""))]
    for i, reward in rewards.items():
        seg.turns[int(i)].reward = json.loads(reward)
    session.held.metas[seg_id] = meta
    session.held.rewards[seg_id] = [t.reward for t in seg.turns]
    return seg


def incomplete(session_id: str, what: str) -> Conflict:
    return Conflict(
        f"session {session_id} is incomplete in Redis ({what} shorter than its header says: a key was evicted or "
        "deleted): it cannot go on; open another session"
    )
