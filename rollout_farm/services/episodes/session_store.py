"""Sessions in Redis: one JSON value per session under `farm:<app>:sess:<id>`, expiring ttl_s after its last change,
so a session survives an ingress restart and every ingress replica serves it. A lock per session runs its turns one
at a time (a retry waits for the turn it repeats, then gets its answer).
"""

from __future__ import annotations

import contextlib
import json
import re
from dataclasses import dataclass, field, fields

from redis.asyncio import Redis
from redis.exceptions import LockError

from rollout_farm.services.episodes.segments import Segment
from rollout_farm.services.errors import Conflict, NotFound

TURN_LOCK_S = 600  # a turn holds its session's lock at most this long (a lost holder's lock lapses)
SESSION_ID = re.compile(r"[0-9a-f]{32}")  # what Sessions.open gives (uuid4 hex)


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

    @property
    def head(self) -> Segment:
        return self.segments[-1]

    def to_json(self) -> str:
        """The session as JSON, each segment as its own JSON text (its fields are plain values: no deep copy of the
        segments, which asdict would make only for them to be replaced: it was half a turn's bookkeeping)."""
        plain = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "segments"}
        return json.dumps({**plain, "segments": [s.to_json() for s in self.segments]}, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> Session:
        data = json.loads(text)
        return cls(**{**data, "segments": [Segment.from_json(s) for s in data["segments"]]})


class SessionStore:
    def __init__(self, r: Redis, prefix: str):
        self.r, self.prefix = r, f"{prefix}:sess:"

    def key(self, session_id: str) -> str:
        """The session's Redis key; 404 for an id no session can have (so no other key is ever read as a session)."""
        if not SESSION_ID.fullmatch(session_id):
            raise NotFound(f"no session {session_id[:80]!r}: session ids are what POST /v1/sessions answers")
        return self.prefix + session_id

    async def create(self, session: Session) -> None:
        if not await self.r.set(self.key(session.id), session.to_json(), ex=int(session.ttl_s) or 1, nx=True):
            raise Conflict(f"session {session.id} exists already")

    async def load(self, session_id: str) -> Session:
        text = await self.r.get(self.key(session_id))
        if text is None:
            raise NotFound(
                f"no session {session_id!r}: it was never opened, or it expired (ttl_s after its last turn) or was "
                "deleted; open one with POST /v1/sessions"
            )
        return Session.from_json(text)

    async def save(self, session: Session) -> None:
        await self.r.set(self.key(session.id), session.to_json(), ex=int(session.ttl_s) or 1)

    async def delete(self, session_id: str) -> bool:
        return bool(await self.r.delete(self.key(session_id)))

    async def ids(self) -> list[str]:
        keys = [k async for k in self.r.scan_iter(match=self.prefix + "*", count=500)]
        return sorted(k[len(self.prefix) :] for k in keys if not k.endswith(":lock"))

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
