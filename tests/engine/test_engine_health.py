"""Weights that cannot be sampled from: NaN or inf in a push is refused at staging, naming the tensor, and the health
check samples (temperature 1), so an engine whose weights hold NaN is reported unhealthy where greedy decoding
would still hand out a token."""

import pytest
import torch
from safetensors.torch import load_file

from rollout_farm.services.engine import WeightsRejected
from rollout_farm.services.engine.torch import TorchEngine
from rollout_farm.services.protocol import SamplingParams
from rollout_farm.services.weights.state_dict import canonical_state_dict


@pytest.fixture
def fresh_engine(tiny_model):
    """An engine of its own: these tests break its weights."""
    return TorchEngine(str(tiny_model), threads=1)


def test_a_healthy_engine_samples_a_token(fresh_engine):
    assert 0 <= fresh_engine.health() < len(fresh_engine.tokenizer)


def test_an_engine_with_nan_weights_is_unhealthy_though_greedy_decoding_still_answers(fresh_engine):
    with torch.no_grad():
        canonical_state_dict(fresh_engine.model)["model.norm.weight"].fill_(float("nan"))
    greedy = fresh_engine.generate([[fresh_engine.health_token_id()]], SamplingParams(temperature=0, max_new_tokens=1))
    assert len(greedy[0].token_ids) == 1  # the old greedy check passed on these weights
    with pytest.raises(RuntimeError):
        fresh_engine.health()


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_staging_non_finite_weights_is_refused_naming_the_tensor(fresh_engine, tiny_model, value):
    state = load_file(tiny_model / "model.safetensors")
    bad = dict(state, **{"model.layers.1.mlp.up_proj.weight": state["model.layers.1.mlp.up_proj.weight"].clone()})
    bad["model.layers.1.mlp.up_proj.weight"][3, 5] = value
    with pytest.raises(WeightsRejected) as e:
        fresh_engine.stage_weights(bad, 1)
    assert "'model.layers.1.mlp.up_proj.weight' holds" in str(e.value) and "push finite weights" in str(e.value)
    assert ("1 NaN" if value != value else "1 inf") in str(e.value)
    fresh_engine.stage_weights(state, 1)  # the same tensors, finite: staged
    fresh_engine.commit_weights(1)
    assert fresh_engine.weight_version == 1 and fresh_engine.health() >= 0
