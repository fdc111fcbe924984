"""The ingress's backstop against the worst bug of shared farms: a sample from another policy than its request named.

Every sample of a rollout on an adapter must carry that adapter, that version, and the digest the push recorded;
each replica stamps the digest it computed from the bytes it loaded (rollout_farm/services/replica/adapter_verbs.py),
so a replica that serves other bytes under the name is caught here. Fanout and the group filter check every part
before it is recorded.
"""

from __future__ import annotations

from rollout_farm.services import protocol as P
from rollout_farm.services.errors import PolicyMismatch


def check_policy(groups: list[P.Group], resolved: tuple[P.AdapterRef, str] | None) -> list[P.Group]:
    """The backstop: every sample of a rollout on an adapter carries that adapter version's digest, or nothing is
    delivered (a 503 naming the sample's policy): a sample from another policy must never reach a trainer."""
    if resolved is None:
        return groups
    ref, digest = resolved
    for g in groups:
        for s in g.samples:
            p = s.policy
            if p is None or (p.adapter, p.adapter_version, p.digest) != (ref.name, ref.version, digest):
                raise PolicyMismatch(
                    f"a sample for {ref.key()} (digest {digest}) came with policy {p and p.model_dump()}: nothing "
                    "was delivered; retry (the replica reloads the adapter)"
                )
    return groups
