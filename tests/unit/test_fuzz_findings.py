"""What a fuzzing run with a fresh seed found (issue 27), each fixed where it belongs, and the checks that find its
kind again:
- a request model built inside a handler from request data raised pydantic's ValidationError: a 500. It is a 422
  naming the field now (rollout_farm/services/errors.py, model_gap), logged as a missing check; other models' errors
  stay 500s;
- the chat endpoint built a prompt from messages that render to nothing: a 422 naming `messages`;
- the published schema accepted what the API refuses: int64 bounds written as 2**63, optional header and query
  parameters that may be null, a range pydantic wrote as "ge"/"le", plain floats without the subnormal rule, a
  version pattern of 19 digits, a weight push without a request body;
- a 422 from the request's own validation says the request does not match its schema (the fuzz test fails on those
  for schema-valid cases), unless its rule is one JSON Schema cannot say (beyond_schema);
- expected refusals (a cut request body, a refused stage, the torch engine's NCCL verbs) are answered without a
  traceback: one warning line (tests/service/test_refusal_logs.py reads the service's logs).
"""

import asyncio
import json
import logging
import random
import re

import pytest
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.testclient import TestClient
from pydantic import ValidationError
from ray.exceptions import TaskCancelledError
from starlette.requests import ClientDisconnect

from rollout_farm.services import protocol as P
from rollout_farm.services.api import create_api
from rollout_farm.services.api import errors as api_errors
from rollout_farm.services.compat.openai_api import OpenAICompat
from rollout_farm.services.errors import (
    MODEL_GAP,
    SCHEMA_MISMATCH,
    ClientGone,
    Conflict,
    EngineVerbMissing,
    Invalid,
    ServiceError,
    as_service_error,
    request_models,
)
from rollout_farm.services.models import byte_tokenizer
from rollout_farm.services.protocol.common import INT64_MAX, SUBNORMAL, decimal_at_most
from rollout_farm.services.protocol.sessions import SessionChatRequest
from rollout_farm.services.protocol.sglang_native import VERSION


def handler_app() -> TestClient:
    """An app with the service's error handlers and routes that build models from what they are sent."""
    api = FastAPI()
    api_errors.install(api)

    @api.post("/prompt")
    async def prompt(request: Request):
        return P.Prompt(**await request.json()).model_dump()

    @api.post("/sampling")
    async def sampling(request: Request):
        return P.SamplingParams(**await request.json()).model_dump()

    @api.post("/sample")
    async def sample(request: Request):  # a response model: its ValidationError is the service's bug
        return P.Sample(**await request.json()).model_dump()

    @api.post("/cut")
    async def cut():
        raise ClientDisconnect()

    @api.post("/cancelled")
    async def cancelled():  # what Serve's receive() raised mid-body in CI: a 500 and Ray's traceback, before the fix
        raise TaskCancelledError()

    return TestClient(api, raise_server_exceptions=False)


def test_a_request_model_built_in_a_handler_refusing_the_request_is_a_422_naming_the_field(caplog):
    client = handler_app()
    with caplog.at_level(logging.WARNING, logger="farm.service"):
        r = client.post("/sampling", json={"top_p": 5})
        assert r.status_code == 422, r.text
        assert MODEL_GAP in r.json()["error"]
        assert [d["field"] for d in r.json()["detail"]] == ["top_p"]
        r = client.post("/prompt", json={"text": ""})  # the chat endpoint's case: a model validator, no field
        assert r.status_code == 422 and "text is empty" in r.json()["detail"][0]["message"], r.text
    gaps = [rec for rec in caplog.records if rec.getMessage() == "request_model_gap"]
    assert [g.model for g in gaps] == ["SamplingParams", "Prompt"]  # a line each, so the missing check gets fixed
    assert not [rec for rec in caplog.records if rec.levelno >= logging.ERROR]


def test_any_other_models_validation_error_stays_a_500_with_its_traceback(caplog):
    with caplog.at_level(logging.WARNING, logger="farm.service"):
        r = handler_app().post("/sample", json={"token_ids": "x"})
    assert r.status_code == 500 and "see the service log" in r.json()["error"], r.text
    (failed,) = [rec for rec in caplog.records if rec.levelno >= logging.ERROR]
    assert failed.exc_info is not None and failed.exc_info[0] is ValidationError


@pytest.mark.parametrize(("path", "says"), [("/cut", "closed the connection"), ("/cancelled", "Serve cancelled")])
def test_a_cut_request_body_is_one_warning_line_and_no_500(caplog, path, says):
    with caplog.at_level(logging.WARNING, logger="farm.service"):
        r = handler_app().post(path)
    assert r.status_code == ClientGone.status == 400 and says in r.json()["error"], r.text
    assert [rec.getMessage() for rec in caplog.records] == ["request_cut"]
    assert caplog.records[0].levelno == logging.WARNING


def test_request_validation_says_schema_mismatch_unless_the_rule_is_beyond_a_schema():
    def refused(**fields) -> ServiceError:
        with pytest.raises(ValidationError) as e:
            P.SamplingParams(**fields)
        return as_service_error(RequestValidationError(e.value.errors()))

    assert refused(top_p=5).message == SCHEMA_MISMATCH  # the schema says maximum 1
    assert refused(temperature=1e-9).message == SCHEMA_MISMATCH  # the schema's `not` says so
    beyond = refused(regex="(")  # whether a regular expression compiles: no schema says that
    assert beyond.status == 422 and beyond.message != SCHEMA_MISMATCH
    assert beyond.detail[0]["field"] == "regex" and "regular expression" in beyond.detail[0]["message"]
    with pytest.raises(ValidationError) as e:  # a tool call's index must be its position
        SessionChatRequest.model_validate(
            {
                "messages": [
                    {
                        "role": "assistant",
                        "tool_calls": [{"id": "a", "function": {"name": "f", "arguments": "{}"}, "index": 3}],
                    }
                ]
            }
        )
    assert as_service_error(RequestValidationError(e.value.errors())).message != SCHEMA_MISMATCH


def test_models_that_are_not_request_models_are_not_taken_for_them():
    names = request_models()
    assert {"Prompt", "SamplingParams", "RolloutRequest", "SessionChatRequest", "QueueSource"} <= names
    assert not {"Sample", "Group", "WeightsPushResponse", "ErrorResponse"} & names


def test_chat_messages_that_render_to_nothing_are_a_422_naming_messages():
    class Replicas:  # the built-in models' template renders a single empty message to ""
        async def read(self, method, *args):
            assert method == "chat_tokenizer"
            return byte_tokenizer()

    compat = OpenAICompat(fanout=None, replicas=Replicas(), checks=None, model="m", committed=None)
    req = P.ChatCompletionRequest(messages=[{"role": "user", "content": ""}])
    with pytest.raises(Invalid) as e:
        asyncio.run(compat.chat(req))
    assert [d["field"] for d in e.value.detail] == ["messages"] and "empty prompt" in e.value.detail[0]["message"]


@pytest.mark.parametrize("n", [1, 5, 9, 10, 19, 20, 99, 100, 101, 250, 4096, INT64_MAX])
def test_decimal_at_most_matches_exactly_one_to_n(n):
    pattern = re.compile(decimal_at_most(n))
    rng = random.Random(n)
    near = [n - 1, n, n + 1, n * 10, n // 10, 10 ** len(str(n)) - 1, 10 ** (len(str(n)) - 1)]
    for v in [*range(0, 300), *near, *(rng.randrange(1, 3 * n + 2) for _ in range(3000))]:
        assert (pattern.fullmatch(str(v)) is not None) == (1 <= v <= n), (n, v)
    for text in ("", "0", "01", "-1", "+1", " 1", "1 ", "1\n", "1.0", "١"):
        assert pattern.fullmatch(text) is None, text


def test_sglangs_string_weight_version_pattern_is_the_farms_versions():
    assert VERSION == decimal_at_most(INT64_MAX)
    assert re.fullmatch(VERSION, str(INT64_MAX)) and not re.fullmatch(VERSION, str(INT64_MAX + 1))
    assert not re.fullmatch(VERSION, "9999999999999999999")  # 19 digits, which the old pattern took


def schema_nodes(node, path=""):
    if isinstance(node, dict):
        yield path, node
        for k, v in node.items():
            yield from schema_nodes(v, f"{path}/{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from schema_nodes(v, f"{path}/{i}")


@pytest.fixture(scope="module")
def doc() -> dict:
    return json.loads(json.dumps(create_api().openapi()))  # as served: through JSON


def test_published_integer_bounds_are_exact(doc):
    bounds = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
    floats = [(p, k, n[k]) for p, n in schema_nodes(doc) for k in bounds if isinstance(n.get(k), float)]
    assert all(not v.is_integer() for _, _, v in floats), [f for f in floats if f[2].is_integer()]
    schemas = doc["components"]["schemas"]
    assert schemas["WeightsFromPath"]["properties"]["version"]["maximum"] == INT64_MAX
    assert schemas["UpdateWeightsFromDiskRequest"]["properties"]["token_step"]["maximum"] == INT64_MAX
    assert schemas["QueueSource"]["properties"]["seed"]["maximum"] == INT64_MAX
    (version,) = [p for p in doc["paths"]["/v1/weights"]["post"]["parameters"] if p["name"] == "version"]
    assert version["schema"]["maximum"] == INT64_MAX and version["schema"]["minimum"] == 1


def test_a_weight_upload_declares_its_body(doc):
    body = doc["paths"]["/v1/weights"]["post"]["requestBody"]
    assert body["required"] is True and body["content"]["application/octet-stream"]["schema"]["format"] == "binary"
    (sha,) = [p for p in doc["paths"]["/v1/weights"]["post"]["parameters"] if p["name"] == "x-content-sha256"]
    assert sha["schema"]["pattern"] == "^[0-9A-Fa-f]{64}$"


def test_no_parameter_may_be_null(doc):
    params = [(path, p) for path, ops in doc["paths"].items() for op in ops.values() for p in op.get("parameters", [])]
    assert params and not [(path, p["name"]) for path, p in params if "null" in json.dumps(p["schema"])]


def test_no_constraint_is_written_in_pydantics_words(doc):
    """pydantic writes a constraint it cannot place (a range on an optional field whose type has a validator) under
    its own name, which JSON Schema ignores."""
    words = {"ge", "le", "gt", "lt", "min_length", "max_length", "multiple_of"}
    assert not [(p, k) for p, n in schema_nodes(doc) if not p.endswith("/properties") for k in n if k in words]


def test_every_float_a_request_takes_is_refused_subnormal_by_the_schema_too(doc):
    """RequestModel refuses subnormal floats in every field; a plain `float` field's schema did not say so (Float's
    `not` SUBNORMAL, or a temperature's own `not`, which leaves out every value between 0 and 1e-6)."""
    names = request_models()
    temperature = {"exclusiveMinimum": 0, "exclusiveMaximum": P.MIN_TEMPERATURE}
    plain = [
        path
        for name, schema in doc["components"]["schemas"].items()
        if name in names
        for path, node in schema_nodes(schema, name)
        if node.get("type") == "number" and node.get("not") not in (SUBNORMAL, temperature)
    ]
    assert "SamplingParams" in names and not plain, plain


def test_the_replica_returns_an_expected_refusal_instead_of_raising_it(monkeypatch):
    """Serve logs a traceback for every exception a replica method raises; the ingress takes a returned error as the
    replica's answer (Replicas.errors and Replicas.all raise it there)."""
    from rollout_farm.services.engine.bench_engine import BenchEngine
    from rollout_farm.services.replica import engine_server, weight_verbs
    from rollout_farm.services.weights.checks import WeightsRejected

    class Refusing(BenchEngine):
        def stage_weights_from_path(self, path, version):
            raise WeightsRejected("tensor 'w' holds 1 NaN")

    server = engine_server.EngineServer.__new__(engine_server.EngineServer)
    server.engine = Refusing()
    refused = asyncio.run(server.stage(("path", "/nowhere"), 3))
    assert isinstance(refused, Invalid) and refused.detail[0]["field"] == "path"
    with pytest.raises(Invalid):  # inside the replica (a commit that stages first) it still raises
        asyncio.run(server._stage(("path", "/nowhere"), 3))
    monkeypatch.setattr(weight_verbs, "replica_id", lambda: "r0")
    server.engine = BenchEngine()
    group = P.DistributedGroup(master_address="x", master_port=1, rank_offset=0, world_size=2)
    missing = asyncio.run(server.init_weights_update_group(group, ["r0"]))
    assert isinstance(missing, EngineVerbMissing) and as_service_error(missing).status == 501
    update = P.DistributedUpdate(names=["a"], dtypes=["float32"], shapes=[[1]], version=2)
    assert isinstance(asyncio.run(server.update_weights_from_distributed(update, ["r0"])), EngineVerbMissing)
    assert not isinstance(refused, Conflict)


def test_a_routing_key_is_printable_ascii_as_serve_needs_it():
    """Serve sends a routing key as the multiplexed model id and cannot encode other characters: a fuzzed key with
    '\\x9e' made the engine replica warn every 100 ms that it could not push its multiplexed ids to the controller."""
    prompts = [{"text": "x"}]
    assert P.RolloutRequest(prompts=prompts, routing_key="session 0~9").routing_key == "session 0~9"
    for key in ("\x9e", "café", "a\nb"):
        with pytest.raises(ValidationError, match="routing_key"):
            P.RolloutRequest(prompts=prompts, routing_key=key)
