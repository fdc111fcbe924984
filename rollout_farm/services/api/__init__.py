"""The HTTP surface: one router per API area, thin routes over the ingress's domain objects
(rollout_farm/services/api/ingress.py).

Each area module has `router` (open to all) and, where it has mutating endpoints, `admin`, included here behind
the bearer token. The routers that generate (GENERATION) need the token too where FARM_REQUIRE_TOKEN_FOR_GENERATION
is on. Errors map to statuses in errors.py.

| module | owns |
| --- | --- |
| `ingress.py` | the ingress deployment: builds the domain objects, follows the committed version, merges metrics |
| `deps.py` | what routes depend on: the ingress replica's domain objects, and `require_token` |
| `errors.py` | the error body and the exception handlers (the status: rollout_farm/services/errors.py) |
| `middleware.py` | the JSON body limit, and request counts and latency for Prometheus (plain ASGI) |
| `uploads.py` | the queue's prompt uploads (JSON or JSONL) within `FARM_MAX_UPLOAD_BYTES`; `line N.<field>` errors |
| `rollouts.py` | `POST /v1/rollouts` (JSON or NDJSON) and `DELETE /v1/rollouts/{request_id}` |
| `sessions.py` | `/v1/sessions` and a session's `chat/completions`, `generate`, `reward`, `close`, `trajectory` |
| `episodes.py` | `POST /v1/episodes` (JSON or NDJSON) and `GET /v1/environments` |
| `samplers.py` | `GET /v1/samplers`, and the policy stats the trainer reports |
| `queue.py` | the queue's sources, prompts, pulls and acks |
| `weights.py` | weight pushes (upload, path, NCCL) and `GET /v1/weights/version` |
| `adapters.py` | LoRA adapters: push (upload, path), list, read with residency, retire; who may sample from one |
| `tenants.py` | tenants and their tokens (admin only): create, list, revoke |
| `control.py` | pause, resume, abort; `/healthz`, `/readyz`, `/metrics` |
| `openai.py` | `/v1/models`, `/v1/completions`, `/v1/chat/completions` |
| `sglang_native.py` | SGLang's native routes: `/generate`, model and server reads, health, weight and control routes |
| `anthropic.py` | a session's Anthropic Messages door: `anthropic/v1/messages` and its `count_tokens` |
| `responses.py` | a session's OpenAI Responses door: `v1/responses` (and `responses`) |
| `vllm_tokens.py` | vLLM's token route, `POST /inference/v1/generate` (token ids in, ids and logprobs out) |
| `tinker.py` | Tinker's sampling API under `/api/v1` for the `tinker` SDK (X-API-Key); training calls a 404 saying so |
"""

from __future__ import annotations

import warnings
from collections import Counter

from fastapi import Depends, FastAPI
from pydantic.json_schema import models_json_schema

from rollout_farm.services import protocol as P
from rollout_farm.services.api import (
    adapters,
    anthropic,
    control,
    episodes,
    errors,
    openai,
    queue,
    responses,
    rollouts,
    samplers,
    sessions,
    sglang_native,
    tenants,
    tinker,
    vllm_tokens,
    weights,
)
from rollout_farm.services.api.deps import require_token, require_token_for_generation
from rollout_farm.services.api.middleware import BodyLimit, RequestMetrics

# What the routes that build their own responses answer with 200 (FastAPI would say JSON); {}: an empty body.
OWN_ANSWERS = {
    "/metrics": {"text/plain": {}},
    "/flush_cache": {"text/plain": {}},
    "/health": {},
    "/health_generate": {},
    "/abort_request": {},
}
STREAMED = {
    "/v1/rollouts": "application/x-ndjson",
    "/v1/episodes": "application/x-ndjson",
    "/generate": "text/event-stream",
}  # the answer to "stream": true
# adapters and tenants check their callers themselves (admin, tenant, or nobody: deps.caller); tinker by X-API-Key
OPEN = (
    samplers.router,
    weights.router,
    queue.router,
    control.router,
    sglang_native.router,
    adapters.router,
    tenants.router,
    tinker.router,
)
GENERATION = (
    rollouts.router,
    openai.router,
    sglang_native.generation,
    vllm_tokens.router,
    sessions.router,
    anthropic.router,
    responses.router,
    episodes.router,
)
NEED_TOKEN = (
    rollouts.admin,
    samplers.admin,
    weights.admin,
    queue.admin,
    control.admin,
    sglang_native.admin,
    sessions.admin,
)


class FarmAPI(FastAPI):
    """FastAPI whose handlers for Serve's errors stay ours: Serve adds plain-text ones (BackPressureError: 503 without
    Retry-After) to the ingress app after create_api() has registered ours (errors.SERVE_ERRORS)."""

    def add_exception_handler(self, exc_class_or_status_code, handler) -> None:
        if exc_class_or_status_code in errors.SERVE_ERRORS and exc_class_or_status_code in self.exception_handlers:
            return
        super().add_exception_handler(exc_class_or_status_code, handler)


def create_api() -> FastAPI:
    api = FarmAPI(
        title="rollout-farm", version=P.API_VERSION, description="Rollout service for LLM reinforcement learning."
    )
    errors.install(api)
    api.add_middleware(BodyLimit)
    api.add_middleware(RequestMetrics)
    unauthorized = {401: {"model": P.ErrorResponse}}
    for router in OPEN:
        api.include_router(router)
    for router in GENERATION:  # open unless FARM_REQUIRE_TOKEN_FOR_GENERATION
        api.include_router(router, dependencies=[Depends(require_token_for_generation)], responses=unauthorized)
    for router in NEED_TOKEN:
        api.include_router(router, dependencies=[Depends(require_token)], responses=unauthorized)
    complete_openapi(api)
    return api


def complete_openapi(api: FastAPI) -> None:
    """/openapi.json as the service answers, resolving in full (tests/service/test_fuzz.py checks both):
    - the models a route reads itself (the queue's JSON-or-JSONL prompts) are components too;
    - the routes that answer something else than JSON say what (OWN_ANSWERS, STREAMED);
    - every 422 is the service's ErrorResponse, not FastAPI's HTTPValidationError; a body not in UTF-8 is a 400;
    - a route with two methods (PUT and POST /generate) gets one operationId per method, not one for both;
    - integer bounds are integers (exact_bounds);
    - an optional query or header parameter is left out, never null: its schema has no null (FastAPI writes
      `str | None` as anyOf string or null, and a client would send the text 'null')."""
    default = api.openapi

    def openapi() -> dict:
        if api.openapi_schema is None:
            with warnings.catch_warnings():  # FastAPI's warning about the shared operationId, fixed below
                warnings.filterwarnings("ignore", "Duplicate Operation ID")
                doc = default()
            schemas = doc["components"]["schemas"]
            _, extra = models_json_schema([(P.QueuePrompts, "validation")], ref_template="#/components/schemas/{model}")
            for name, schema in extra["$defs"].items():
                schemas.setdefault(name, schema)
            error = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
            shared = Counter(op["operationId"] for ops in doc["paths"].values() for op in ops.values())
            for path, ops in doc["paths"].items():
                doc["paths"][path] = ops = dict(sorted(ops.items()))  # a route's methods come from a set: fix the order
                for method, op in ops.items():
                    if path in OWN_ANSWERS:
                        op["responses"]["200"]["content"] = OWN_ANSWERS[path]
                    if path in STREAMED:
                        op["responses"]["200"]["content"][STREAMED[path]] = {}
                    if shared[op["operationId"]] > 1:  # FastAPI's id ends with one of the route's methods
                        op["operationId"] = f"{op['operationId'].rsplit('_', 1)[0]}_{method}"
                    if "422" in op["responses"]:
                        op["responses"]["422"]["content"] = error
                    if "requestBody" in op:  # FastAPI's answer to a body it cannot decode
                        op["responses"]["400"] = {"description": "The body is not UTF-8", "content": error}
                    for parameter in op.get("parameters", []):
                        parameter["schema"] = not_null(parameter["schema"])
            schemas.pop("HTTPValidationError", None)
            schemas.pop("ValidationError", None)
            exact_bounds(doc)
        return api.openapi_schema

    api.openapi = openapi


BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


def exact_bounds(node) -> None:
    """FastAPI's OpenAPI models hold every bound as a float, so INT64_MAX (2**63 - 1) was published as 2**63, a value
    the service refuses. An integral bound is written back as an integer, and 2**63 as the INT64_MAX it came from
    (no bound is 2**63 itself: every integer of a request fits int64)."""
    if isinstance(node, list):
        for item in node:
            exact_bounds(item)
    elif isinstance(node, dict):
        for key, value in node.items():
            if key in BOUNDS and isinstance(value, float) and value.is_integer():
                node[key] = P.INT64_MAX if value == float(P.INT64_MAX) else int(value)
            else:
                exact_bounds(value)


def not_null(schema: dict) -> dict:
    """A parameter's schema without its null alternative."""
    options = [o for o in schema.get("anyOf", []) if o.get("type") != "null"]
    if "anyOf" not in schema or len(options) == len(schema["anyOf"]):
        return schema
    rest = {k: v for k, v in schema.items() if k != "anyOf"}
    return {**rest, **options[0]} if len(options) == 1 else {**rest, "anyOf": options}
