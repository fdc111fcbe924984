"""Generation ahead of training through the service's queue, with a staleness bound.

With `async_training.staleness_threshold` s > 0, before its k-th pull the trainer has fed the prompts of steps 1 to
k + s to its queue source (rollout_farm/trainer/sync/rollouts.py lease_groups; never past the last step). The service's
generation loop for the source (rollout_farm/services/queue/generation.py) works through them in order, in the
background, while the trainer trains: when step k trains, the groups of steps k+1 to k+s are being generated or are
ready. The source keeps up to (s + 1) x train_batch_size groups ready (`target_groups`), so the feed, not the target, is
what paces generation.

The bound. A group is leased only if none of its samples is older than s versions: staleness = the trainer's
version minus the oldest weight version among the sample's tokens
(rollout_farm/trainer/outputs/staleness_metrics.py). Two checks enforce it:
  - the service's, at the pull (`max_staleness` = s): it compares with its committed version, which is the
    trainer's (the trainer is the only one pushing, and push_weights returns once the version is served); an older
    group is dropped and its prompt generated again on the current weights (`stale_dropped_groups`);
  - the trainer's, on what it received, against its own version: a group that is still too old is refused, left
    unacked, so that the queue drops it at its lease's end and generates its prompt again (`refused_groups`;
    0 unless the two versions disagree).
In steady state nothing is dropped: the prompts fed at step k (version v) are generated on v or later and pulled at
step k + s, when the trainer is at v + s. Drops happen when versions move faster than steps (a rollback pushes one
more) or after a restart.

With LoRA the versions are the adapter's, which the service's pull check does not see (it counts base versions):
the trainer's check alone enforces the bound. Each group is first verified (rollout_farm/trainer/sync/adapter.py:
its policy digest checked, its samples' versions made the adapter's), and a group too old, or from a version this
trainer never pushed, is settled and its prompt fed again (`requeue`), since the service would deliver it again as
it is.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from rollout_farm.services import protocol as P
from rollout_farm.services.client import FarmClient
from rollout_farm.trainer.config import Config

QUEUE_WAIT_S = 600  # for a step's groups from the queue
PULL_WAIT_S = 30  # each pull waits up to this long for a first group


@dataclass
class Leased:
    items: list[P.QueueItem] = field(default_factory=list)
    stale_dropped: int = 0  # groups the service dropped at these pulls as too old (their prompts generate again)
    refused: int = 0  # groups the trainer found too old itself, left unacked


def too_old(group: P.Group, version: int, bound: int | None) -> bool:
    oldest = group.oldest_version()
    return bound is not None and oldest is not None and version - oldest > bound


def lease(
    client: FarmClient,
    source: str,
    want: int,
    version: int,
    bound: int | None,
    lease_s: float,
    wait_s: float = QUEUE_WAIT_S,
    verify: Callable[[P.Group], P.Group | None] | None = None,
    requeue: Callable[[list[P.QueueItem]], None] | None = None,
) -> Leased:
    """Lease `want` groups from the source, none older than `bound` versions behind `version` (None: any age). With
    `verify`, each group as it returns it, refused when it returns None; `requeue` gets the refused groups of each
    pull (else they are left unacked)."""
    out = Leased()
    deadline = time.monotonic() + wait_s
    while len(out.items) < want:
        if time.monotonic() > deadline:
            raise RuntimeError(f"queue source {source!r} delivered {len(out.items)} of {want} groups in {wait_s} s")
        req = P.PullRequest(
            source=source, max_groups=want - len(out.items), max_staleness=bound, lease_s=lease_s, wait_s=PULL_WAIT_S
        )
        got = client.queue_pull(req)
        out.stale_dropped += got.stale_dropped
        refused = []
        for item in got.items:
            group = verify(item.group) if verify else item.group
            if group is None or too_old(group, version, bound):
                refused.append(item)
            else:
                out.items.append(item if group is item.group else item.model_copy(update={"group": group}))
        out.refused += len(refused)
        if refused and requeue:
            requeue(refused)
    return out


def target_groups(cfg: Config) -> int:
    """Groups the trainer's source keeps ready: those of the current step and of the s steps fed ahead."""
    return min(4096, (cfg.async_training.staleness_threshold + 1) * cfg.data.train_batch_size)


def rollout_idle(before: tuple[float, float] | None, state: P.QueueSourceState) -> dict:
    """rollout_idle_ratio: the share of the time since `before` (the source's generation busy and idle seconds at
    the previous pull) that the service's generation loop for the source had nothing it was allowed to generate.
    {} at the first pull."""
    if before is None:
        return {}
    busy, idle = state.generation_busy_s - before[0], state.generation_idle_s - before[1]
    if busy + idle <= 0:
        return {}
    return {"rollout_idle_ratio": max(0.0, idle) / (busy + idle)}
