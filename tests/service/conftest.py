"""Tests against the real service: one Ray Serve app per session on 127.0.0.1 (see tests/conftest.py)."""

import pytest

from tests.conftest import mark_folder


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    mark_folder(items, __file__, "integration")


@pytest.fixture(scope="module")
def folders(tiny_model, tmp_path_factory):
    """Five peft adapters on the tiny model, by seed."""
    from tests.adapters import peft_adapter

    root = tmp_path_factory.mktemp("adapters")
    return {seed: peft_adapter(tiny_model, root / f"a{seed}", seed=seed) for seed in (1, 2, 3, 4, 5)}


@pytest.fixture
def http(service, fresh_weights):
    """An HTTP client on a service serving the model folder's weights; every adapter retired and every tenant revoked
    afterwards, so that the other tests' base pushes are not refused and no quota outlives its test."""
    import httpx

    from tests.adapters import ADMIN

    with httpx.Client(base_url=service, timeout=120) as c:
        yield c
        for a in c.get("/v1/adapters", headers=ADMIN).json()["adapters"]:
            c.delete(f"/v1/adapters/{a['name']}", headers=ADMIN)
        for t in c.get("/v1/tenants", headers=ADMIN).json()["tenants"]:
            c.delete(f"/v1/tenants/{t['tenant']}", headers=ADMIN)
