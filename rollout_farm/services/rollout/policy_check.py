"""The ingress's backstop against the worst bug of shared farms: a sample from another policy than its request named.

Every sample of a rollout on an adapter must carry that adapter, that version, and the digest the push recorded;
each replica stamps the digest it computed from the bytes it loaded (rollout_farm/services/replica/adapter_verbs.py),
so a replica that serves other bytes under the name is caught here. Such a sample never spans a base commit: all of
its tokens are on its policy's base version, and it carries no `policies`. A sample on the base that spans commits
names every policy of its tokens (P.Sample.policies), one per base version among them, the first its `policy`.
Fanout and the group filter check every part before it is recorded.
"""

from __future__ import annotations

from rollout_farm.services import protocol as P
from rollout_farm.services.errors import PolicyMismatch


def check_policy(groups: list[P.Group], resolved: tuple[P.AdapterRef, str] | None) -> list[P.Group]:
    """The backstop: every sample of a rollout on an adapter carries that adapter version's digest on every token, and
    every sample that spans base commits names each token's policy; or nothing is delivered (a 503 naming the
    sample's policy): a sample from another policy must never reach a trainer."""
    for g in groups:
        for s in g.samples:
            if resolved is not None:
                _on_adapter(s, *resolved)
            elif s.policies is not None:
                _spans(s)
    return groups


def _on_adapter(s: P.Sample, ref: P.AdapterRef, digest: str) -> None:
    p = s.policy
    if p is None or (p.adapter, p.adapter_version, p.digest) != (ref.name, ref.version, digest):
        raise PolicyMismatch(
            f"a sample for {ref.key()} (digest {digest}) came with policy {p and p.model_dump()}: nothing was "
            "delivered; retry (the replica reloads the adapter)"
        )
    versions = set(s.token_weight_versions or [s.weight_version])
    if s.policies is not None or versions != {p.base_version}:
        raise PolicyMismatch(
            f"a sample for {ref.key()} spans base versions {sorted(versions)}, but the adapter was pushed on "
            f"v{p.base_version} alone: nothing was delivered; push the adapter again on the base served now"
        )


def _spans(s: P.Sample) -> None:
    """A base sample's policies: distinct base versions in token order, the first its `policy`, one per version of
    its tokens, none on an adapter."""
    policies, versions = s.policies, list(dict.fromkeys(s.token_weight_versions or [s.weight_version]))
    if [p.base_version for p in policies] != versions or policies[0] != s.policy or any(p.adapter for p in policies):
        raise PolicyMismatch(
            f"a sample's policies ({[p.model_dump() for p in policies]}) do not name the base versions of its tokens "
            f"({versions}), first to last: nothing was delivered; retry"
        )
