"""An upload staged while it streams: each bucket goes to every replica, and to the weight store to copy, as soon as
it is in the object store, while the next one streams in (rollout_farm/services/weights/push.py runs this under the push
lock).

  bucket    every replica stages the bucket (`stage_bucket`, rollout_farm/services/weights/stage.py: checksums, NaN and
  inf);
            the call carries the manifest's entries for the bucket's tensors, as the replicas stage buckets
            concurrently and in any order. A refusal already answered stops the upload at its next bucket.
  settle    after the last bucket: wait for every bucket's calls; any refusal refuses the push
  abandon   whatever went wrong (a refusal, a cut or damaged body, the caller gone): wait for the calls still in
            flight, then every replica discards what it staged

Nothing is served from a staged bucket: the push's stage phase then checks the whole push on every replica
(rollout_farm/services/weights/stage.py Staging.finish), and only its commit changes the served version.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from rollout_farm.services.errors import ClientGone, call_cancelled
from rollout_farm.services.weights.manifest import Manifest


def entries(manifest: Manifest | None, names: set[str]) -> Manifest | None:
    """The manifest cut down to a bucket's tensors (its hash and base kept): what a replica needs to check them."""
    if manifest is None:
        return None
    return Manifest(manifest.hash, manifest.base, {n: manifest.tensors[n] for n in names if n in manifest.tensors})


def outcome(call: asyncio.Future) -> list[BaseException]:
    """A finished bucket call's errors: the replicas' ([] when all staged it), or the call's own (cancelled)."""
    if call.cancelled():
        return [asyncio.CancelledError()]
    if (e := call.exception()) is not None:
        return [e]
    return call.result()


class EarlyStage:
    def __init__(
        self,
        replicas,
        version: int,
        timeout_s: float,
        setting: str,
        refuse: Callable[[list[Exception]], Exception | None],
        hold: bool,
    ):
        """`replicas`: the ingress's handle (rollout_farm.services.replica.handle.Replicas). `refuse` turns the
        replicas' errors into the exception that refuses the push, or None when none refuses (a replica that died is no
        refusal). `hold`: the store copies each bucket as it arrives (a large upload)."""
        self.replicas, self.version, self.timeout_s, self.setting = replicas, version, timeout_s, setting
        self.refuse, self.hold = refuse, hold
        self.calls: list[asyncio.Future] = []
        self.refs: list = []
        self.copy: asyncio.Future | None = None  # the store's copy of the buckets so far

    async def bucket(self, index: int, ref, names: set[str], manifest: Manifest | None) -> None:
        """Send bucket `index` to every replica to stage (after raising a refusal that came meanwhile)."""
        self._raise_refused([outcome(c) for c in self.calls if c.done()])
        self.refs.append(ref)
        call = self.replicas.errors(
            "stage_bucket",
            self.version,
            index,
            [ref],  # in a list: Ray passes it on as a reference, not the bucket's bytes
            entries(manifest, names),
            timeout_s=self.timeout_s,
            setting=self.setting,
        )
        self.calls.append(asyncio.ensure_future(call))
        if self.hold:
            self.copy = asyncio.ensure_future(self._hold(self.copy, ("bytes", list(self.refs))))

    def hold_rest(self, source: tuple) -> asyncio.Future:
        """The store copies what it has not of the whole upload `source`, after the copies under way."""
        return asyncio.ensure_future(self._hold(self.copy, source))

    async def _hold(self, before: asyncio.Future | None, source: tuple) -> None:
        """The store copies the buckets of `source`, after its copy of the ones before (one call at a time, in
        order: rollout_farm/services/weights/store.py copies only the buckets it has not)."""
        if before is not None:
            with contextlib.suppress(Exception):
                await before
        await self.replicas.call("record", self.version, source, True)

    async def settle(self) -> None:
        """Every bucket staged on every replica; the push's refusal if any replica refused one."""
        if self.calls:
            await asyncio.wait(self.calls)
        self._raise_refused([outcome(c) for c in self.calls])

    async def held(self) -> None:
        """The store's copy done (a failed copy is taken again at the commit)."""
        if self.copy is not None:
            with contextlib.suppress(Exception):
                await self.copy

    async def abandon(self) -> None:
        """Wait for the calls in flight, then every replica discards the version (its staged buckets)."""
        await asyncio.gather(*self.calls, return_exceptions=True)
        await self.held()
        if self.calls:
            with contextlib.suppress(Exception):
                await self.replicas.each("discard", self.version)

    def _raise_refused(self, results: list[list[BaseException]]) -> None:
        errors = [e for errors in results for e in errors]
        if any(call_cancelled(e) for e in errors):  # Serve cancelled the request's calls: its client went away
            raise ClientGone()
        if errors and (refusal := self.refuse(errors)) is not None:
            raise refusal
