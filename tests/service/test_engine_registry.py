"""Engines come from one registry: by name, or by dotted path from a FARM_PLUGINS module. A verb an engine lacks
is a 501 naming the engine. The bench engine serves a whole app with no model."""

import httpx
import pytest

from tests.conftest import TOKEN

AUTH = {"Authorization": f"Bearer {TOKEN}"}


NCCL_UPDATE = {"names": ["lm_head.weight"], "dtypes": ["float32"], "shapes": [[1, 1]], "version": 99}


def test_a_user_engine_by_dotted_path_serves_rollouts_without_a_model(bench_service):
    body = {
        "prompts": [{"token_ids": [40, 41, 77]}, {"text": "Q: 1+1\nA:"}],
        "n": 3,
        "sampling_params": {"max_new_tokens": 5, "seed": 1},
    }
    r = httpx.post(f"{bench_service}/v1/rollouts", json=body, timeout=60)
    assert r.status_code == 200, r.text
    first, second = r.json()["groups"]
    assert [s["token_ids"] for s in first["samples"]] == [[77] * 5] * 3  # the echo engine made them
    from rollout_farm.services.models import (
        byte_tokenizer,
    )  # no model folder: the engine tokenizes with the embedded byte tokenizer

    last = byte_tokenizer()("Q: 1+1\nA:", add_special_tokens=False).input_ids[-1]
    assert [s["token_ids"] for s in second["samples"]] == [[last] * 5] * 3
    assert httpx.get(f"{bench_service}/healthz", timeout=30).json()["status"] == "ok"


def test_the_bench_engine_takes_weight_pushes(bench_service):
    import torch
    from safetensors.torch import save

    version = httpx.get(f"{bench_service}/v1/weights/version", timeout=30).json()["version"] + 1
    blob = save({"bench.weight": torch.zeros(1)})
    r = httpx.post(f"{bench_service}/v1/weights", params={"version": version}, content=blob, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    assert httpx.get(f"{bench_service}/v1/weights/version", timeout=30).json()["version"] == version


@pytest.mark.parametrize("app, engine", [("", "TorchEngine"), ("/bench", "EchoEngine")])
def test_a_verb_the_engine_lacks_is_a_501_naming_the_engine(service, bench_service, app, engine):
    url = f"{service}{app}"
    group = {"master_address": "127.0.0.1", "master_port": 29999, "rank_offset": 1, "world_size": 2}
    for path, body in (("/v1/weights/distributed/init", group), ("/v1/weights/distributed", NCCL_UPDATE)):
        r = httpx.post(f"{url}{path}", json=body, headers=AUTH, timeout=60)
        assert r.status_code == 501, r.text
        assert f"the {engine} engine has no NCCL weight transport" in r.json()["error"]
        assert "FARM_ENGINE=sglang" in r.json()["error"]
