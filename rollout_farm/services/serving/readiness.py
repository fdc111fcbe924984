"""When `farm serve` says "rollout service ready": once GET /readyz answers 200, never before.

The replicas are up when serve.run returns, but the farm may still be unable to serve: its committed weight version
cannot be loaded (an upload kept only in the object store of a Ray cluster that is gone, a pushed folder deleted),
or a replica is still catching up. /readyz says why (rollout_farm/services/replica/handle.py; field "weights": weights
that no replica can load until a push). While it answers 503, `farm serve` prints why and what to do, and keeps
serving: the next push (of that version or newer) makes it ready, and then it prints the ready line.
"""

from __future__ import annotations

import threading
import time

import httpx

PATIENCE_S = 30.0  # how long another reason than lost weights (a replica catching up) may last before it is printed
POLL_S = 2.0
LOST_FIX = (
    "to serve again: push weights of that version or newer (the trainer's next push, `farm weights push`), or stop "
    "and run `farm serve --fresh` to start at version 0 from the model folder (it drops the committed version and "
    "the saved queue). Uploads survive a restart when FARM_UPLOADS_DIR keeps them on disk (the default with the "
    "embedded Redis), or push by path."
)


def not_ready(url: str) -> tuple[list[str], bool] | None:
    """None when GET {url}/readyz answers 200; else its reasons, and whether one is weights that cannot be loaded."""
    try:
        r = httpx.get(f"{url}/readyz", timeout=30)
    except httpx.HTTPError as e:
        return [f"/readyz did not answer ({type(e).__name__})"], False
    if r.status_code == 200:
        return None
    try:
        detail = r.json().get("detail") or []
    except ValueError:
        detail = []
    reasons = [d.get("message", "") for d in detail] or [f"/readyz answered {r.status_code}: {r.text[:300]}"]
    return reasons, any(d.get("field") == "weights" for d in detail)


def announce(
    url: str, shown: str, done: threading.Event, patience_s: float = PATIENCE_S, poll_s: float = POLL_S
) -> None:
    """Print "rollout service ready on `shown`" once {url}/readyz answers 200. Until then, print why not (at once
    for weights that cannot be loaded, with what to do; after `patience_s` for anything else), each reason once;
    return early when `done` is set."""
    start, said = time.monotonic(), None
    while not done.is_set():
        found = not_ready(url)
        if found is None:
            print(f"rollout service ready on {shown}", flush=True)
            return
        reasons, lost = found
        if reasons != said and (lost or time.monotonic() - start > patience_s):
            print(f"rollout service up on {shown} but NOT ready: {'; '.join(reasons)}", flush=True)
            if lost:
                print(f"  {LOST_FIX}", flush=True)
            said = reasons
        done.wait(poll_s)
