"""The ingress's backstop (rollout_farm/services/rollout/policy_check.py): a rollout on an adapter delivers nothing if
one of its samples carries another policy. Its negative controls are the failures of an engine that re-used a name for
new bytes (another digest), served the base, or another version."""

import pytest

from rollout_farm.services import protocol as P
from rollout_farm.services.errors import PolicyMismatch
from rollout_farm.services.rollout.policy_check import check_policy

REF, DIGEST = P.AdapterRef(name="run-a", version=3), "xxh3_128:" + "ab" * 16


def groups(policy: P.Policy | None) -> list[P.Group]:
    sample = P.Sample(token_ids=[1], logprobs=[-0.1], text="x", finish_reason="stop", weight_version=2, policy=policy)
    good = P.Sample(
        **{**sample.model_dump(), "policy": P.Policy(base_version=2, adapter="run-a", adapter_version=3, digest=DIGEST)}
    )
    return [P.Group(prompt_token_ids=[5], samples=[good, sample], reward_mean=0, reward_std=0, zero_variance=True)]


def test_samples_of_the_named_policy_pass():
    right = P.Policy(base_version=2, adapter="run-a", adapter_version=3, digest=DIGEST)
    assert check_policy(groups(right), (REF, DIGEST))[0].samples[1].policy == right
    assert check_policy(groups(None), None)  # a rollout on the base: nothing to check here


@pytest.mark.parametrize(
    "wrong",
    [
        P.Policy(base_version=2, adapter="run-a", adapter_version=3, digest="xxh3_128:" + "cd" * 16),  # new bytes
        P.Policy(base_version=2, digest="xxh3_128:" + "ab" * 16),  # the base model
        P.Policy(base_version=2, adapter="run-a", adapter_version=2, digest=DIGEST),  # another version
        P.Policy(base_version=2, adapter="run-b", adapter_version=3, digest=DIGEST),  # another adapter
        None,  # no policy at all
    ],
)
def test_a_sample_of_another_policy_fails_the_whole_rollout(wrong):
    with pytest.raises(PolicyMismatch) as e:
        check_policy(groups(wrong), (REF, DIGEST))
    assert "run-a@v3" in e.value.message and e.value.status == 503


# A sample that spans base commits (issue 37): per-token policies -----------------------------------------------------
D1, D2, D3 = ("xxh3_128:" + c * 32 for c in "123")


def spanning(versions: list[int]) -> P.Sample:
    return P.Sample(
        token_ids=list(range(len(versions))),
        logprobs=[-0.1] * len(versions),
        text="x",
        finish_reason="length",
        weight_version=versions[0],
        token_weight_versions=versions if len(set(versions)) > 1 else None,
    )


def in_group(*samples: P.Sample) -> list[P.Group]:
    return [P.Group(prompt_token_ids=[5], samples=list(samples), reward_mean=0, reward_std=0, zero_variance=True)]


def test_a_base_sample_that_spans_commits_names_each_tokens_policy():
    from rollout_farm.services.replica.adapter_verbs import PolicyStamp

    known = {3: D2, 4: D3}  # the engine's recent digests; v2 is the one served when the rollout started
    stamp = PolicyStamp((2, D1), None, known.get)
    one, two = spanning([2, 2, 3, 3, 4]), spanning([2, 2])
    stamp.stamp(in_group(one, two))
    assert [(p.base_version, p.digest) for p in one.policies] == [(2, D1), (3, D2), (4, D3)]
    assert one.policy == one.policies[0] and one.policy.adapter is None
    assert [p.digest for p in one.token_policies()] == [D1, D1, D2, D2, D3]
    assert two.policies is None and two.token_policies() == [two.policy] * 2 and two.policy.digest == D1
    assert check_policy(in_group(one, two), None)
    wire = P.Sample.model_validate_json(one.model_dump_json())
    assert wire.policies == one.policies  # on the wire: the distinct policies, joined to tokens by base_version


@pytest.mark.parametrize(
    "broken",
    [
        lambda s: s.policies.reverse(),  # not in token order
        lambda s: s.policies.pop(),  # a version of its tokens without a policy
        lambda s: setattr(s, "policy", s.policies[1]),  # `policy` is not the first token's
        lambda s: s.policies.__setitem__(1, s.policies[1].model_copy(update={"adapter": "run-a"})),  # an adapter
    ],
)
def test_policies_that_do_not_match_the_tokens_fail_the_rollout(broken):
    s = spanning([2, 3])
    s.policy = P.Policy(base_version=2, digest=D1)
    s.policies = [s.policy, P.Policy(base_version=3, digest=D2)]
    assert check_policy(in_group(s), None)
    broken(s)
    with pytest.raises(PolicyMismatch):
        check_policy(in_group(s), None)


def test_an_adapter_sample_never_spans_a_base_commit():
    """The replica refuses the rollout (a 409: the base changed under the adapter, a forced base push), and the
    ingress would refuse such a sample anyway."""
    from rollout_farm.services.replica.adapter_verbs import PolicyStamp

    stamp = PolicyStamp((2, D1), (REF, DIGEST), {3: D2}.get, D1)
    answer = stamp.stamp(in_group(spanning([2, 3])))
    assert answer.status == 409 and "run-a@v3" in answer.message and "v3" in answer.message
    rerun = PolicyStamp((2, D1), (REF, DIGEST), {3: D2}.get, D1).stamp(in_group(spanning([3, 3])))  # "abort" rerun
    assert rerun.status == 409
    stale = PolicyStamp((3, D2), (REF, DIGEST), {}.get, D1).stamp(in_group(spanning([3])))  # committed before it ran
    assert stale.status == 409
    fine = PolicyStamp((2, D1), (REF, DIGEST), {}.get, D1).stamp(in_group(spanning([2, 2])))
    assert fine[0].samples[0].policy == P.Policy(base_version=2, adapter="run-a", adapter_version=3, digest=DIGEST)
    s = spanning([2, 3])
    s.policy = P.Policy(base_version=2, adapter="run-a", adapter_version=3, digest=DIGEST)
    with pytest.raises(PolicyMismatch) as e:
        check_policy(in_group(s), (REF, DIGEST))
    assert "spans base versions [2, 3]" in e.value.message
