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
