"""FARM_REQUIRE_TOKEN_FOR_GENERATION, on the real app (create_api) through FastAPI's TestClient. The ingress replica
is replaced by an object holding only the settings: the token check runs before any handler, and a request that
passes it stops at the body check (422), so no handler, Ray or engine is reached. Its tenants know no token (the
tenant tokens themselves: tests/service/test_tenants.py, on the real service and Redis)."""

from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from rollout_farm.services.api import create_api, deps
from rollout_farm.services.config.settings import ServiceSettings
from tests.conftest import TOKEN

GENERATING = [  # an empty body: a request past the token check is a 422
    ("post", "/v1/rollouts"),
    ("post", "/v1/completions"),
    ("post", "/v1/chat/completions"),
    ("post", "/generate"),
    ("post", "/v1/sessions"),
    ("post", "/v1/episodes"),
]


def client(required: bool) -> TestClient:
    api = create_api()
    settings = ServiceSettings(api_token=TOKEN, require_token_for_generation=required)

    async def no_tenant(token: str) -> None:
        return None

    tenants = SimpleNamespace(of_token=no_tenant)
    api.dependency_overrides[deps.ingress] = lambda: SimpleNamespace(settings=settings, tenants=tenants)
    return TestClient(api)


@pytest.mark.parametrize("method, path", GENERATING)
def test_generation_needs_the_token_only_where_required(method, path):
    shared, local = client(True), client(False)
    refused = getattr(shared, method)(path, json={"bad": 1})
    assert refused.status_code == 401 and "FARM_API_TOKEN" in refused.json()["error"]
    wrong = getattr(shared, method)(path, json={"bad": 1}, headers={"Authorization": "Bearer wrong-token-123"})
    assert wrong.status_code == 401
    admitted = getattr(shared, method)(path, json={"bad": 1}, headers={"Authorization": f"Bearer {TOKEN}"})
    assert admitted.status_code == 422  # past the token, at the body check
    assert getattr(local, method)(path, json={"bad": 1}).status_code == 422  # the default: open


def test_probes_stay_open_and_the_schema_says_which_routes_may_answer_401():
    paths = create_api().openapi()["paths"]
    for method, path in GENERATING:
        assert "401" in paths[path][method]["responses"], path
    for path in ("/healthz", "/readyz", "/health", "/v1/weights/version"):
        assert "401" not in paths[path]["get"]["responses"], path
