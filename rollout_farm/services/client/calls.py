"""One call of the farm's API on the wire, for rollout_farm/services/client/farm_client.py: what it sends, how its
answer is read (an error answer is a FarmError with the service's detail and its Retry-After), whether a failed attempt
may be sent again, and the lines of a streamed rollout."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from typing import Any

import httpx

from rollout_farm.services import protocol as P

# 500 too: the service never answers it (a route's failure is a 4xx or a 503), so it comes from the front: Serve's
# proxy when the replica holding the request died, HAProxy normalising its own 502-504. A replay by request_id is safe.
RETRY_STATUS = {429, 500, 502, 503, 504}
# weights go up in slices this big: httpcore copies one big bytes body, slices it sends as they are
CHUNK_BYTES = 8 << 20


class FarmError(RuntimeError):
    """An error answer: its HTTP status and body (the service's {"error", "detail"}, or the text if not JSON)."""

    def __init__(self, status: int, body: dict | str, retry_after: float | None = None):
        self.status, self.body, self.retry_after = status, body, retry_after
        super().__init__(f"HTTP {status}: {body}")


def _checked(r: httpx.Response) -> httpx.Response:
    """The response if it succeeded, else FarmError; a 429 or 503 carries its Retry-After in seconds."""
    if r.status_code < 400:
        return r
    try:
        body = r.json()
    except ValueError:
        body = r.text
    try:
        after = max(0.0, float(r.headers["retry-after"])) if r.status_code in (429, 503) else None
    except (KeyError, ValueError):  # absent, or an HTTP date: the backoff decides
        after = None
    raise FarmError(r.status_code, body, after)


def _front_without_routes(e: FarmError) -> bool:
    """A 404 of Ray Serve's front itself, never the service's (whose errors are JSON): its proxy or HAProxy has just
    started and has no route to the app yet ("Path '/v1/rollouts' not found. Ping http://.../-/routes ..."). The
    request never reached the service."""
    return e.status == 404 and isinstance(e.body, str) and "/-/routes" in e.body


def _retryable(e: BaseException, replay: bool) -> bool:
    """Whether a failed attempt may be sent again; without replay, only when the service cannot have acted on it."""
    if isinstance(e, FarmError):
        return e.status in (RETRY_STATUS if replay else {429}) or _front_without_routes(e)
    return isinstance(e, httpx.ConnectError) or (replay and isinstance(e, httpx.TransportError))


def _slices(data: bytes | Callable[[], Iterable]) -> Iterator[memoryview]:
    """The upload in slices of at most CHUNK_BYTES: bytes, or a callable giving its pieces afresh (each attempt)."""
    for piece in data() if callable(data) else (data,):
        view = memoryview(piece).cast("B")
        yield from (view[i : i + CHUNK_BYTES] for i in range(0, len(view), CHUNK_BYTES))


async def _aslices(data: bytes | Callable[[], Iterable]) -> AsyncIterator[memoryview]:
    for s in _slices(data):
        yield s


def _rollout_body(req: P.RolloutRequest, stream: bool = False) -> dict:
    """The request under a request_id (a fresh one unless given), so that every retry is a replay."""
    update = {"stream": stream, "request_id": req.request_id or uuid.uuid4().hex}
    return req.model_copy(update=update).model_dump(exclude_none=True)


class _Call:
    """One call of the API: what to send, the model of its answer (of each item of a list; None: the JSON as it is),
    and whether it is safe to send twice. `upload` goes in slices of CHUNK_BYTES, a fresh iterator per attempt."""

    def __init__(
        self,
        method: str,
        path: str,
        returns: Any,
        replay: bool = True,
        upload: bytes | Callable[[], Iterable] | None = None,
        **kw,
    ):
        self.method, self.path, self.returns = method, path, returns
        self.replay, self.upload, self.kw = replay, upload, kw

    def request_kw(self, slices: Callable[[Any], Any]) -> dict:
        return self.kw if self.upload is None else {**self.kw, "content": slices(self.upload)}

    def answer(self, r: httpx.Response) -> Any:
        data = _checked(r).json()
        if self.returns is None:
            return data
        if isinstance(data, list):
            return [self.returns.model_validate(d) for d in data]
        return self.returns.model_validate(data)

    def retryable(self, e: BaseException) -> bool:
        return _retryable(e, self.replay)


class _Stream:
    """What both streams share: the body under one request_id, the reading of each line, and the rule that a stream
    is retried only until its first group arrives (the request_id makes that retry a replay, not a second rollout)."""

    def __init__(self, req: P.RolloutRequest):
        self.body = _rollout_body(req, stream=True)
        self.status, self.started, self.done = 0, False, False
        self.partial = ""

    def lines(self, text: str) -> list[str]:
        """The whole lines in the text received so far. NDJSON splits on "\n" alone: httpx's iter_lines would also
        split on characters a sample's text may hold (\x1c-\x1e, \x85, \u2028), breaking its JSON line."""
        *whole, self.partial = (self.partial + text).split("\n")
        return whole

    def retryable(self, e: BaseException) -> bool:  # e.g. queues full before any group: that job is forgotten
        return not self.started and _retryable(e, replay=True)

    def open(self, r: httpx.Response) -> None:
        """Start reading an answer (afresh on each attempt); raise FarmError for an error answer (its body read)."""
        self.status, self.partial = _checked(r).status_code, ""

    def events(self, text: str) -> Iterator[P.GroupEvent]:
        """The groups of the whole lines in the text received so far, one by one, up to the closing line (then
        `done` is set); FarmError when the closing line carries an error."""
        for line in self.lines(text):
            if event := self.read(line):
                yield event
            elif self.done:
                return

    def read(self, line: str) -> P.GroupEvent | None:
        """The line's group; None for a blank line or the closing one (then `done` is set); FarmError when the
        closing line carries an error."""
        if not line:
            return None
        data = json.loads(line)
        if "done" not in data:
            self.started = True
            return P.GroupEvent.model_validate(data)
        end = P.StreamEnd.model_validate(data)
        if end.error:
            raise FarmError(end.status or self.status, P.ErrorResponse(error=end.error).model_dump())
        self.done = True
        return None

    def cut(self) -> FarmError:
        error = "stream closed before its last line: the service went away"
        return FarmError(self.status, P.ErrorResponse(error=error).model_dump())
