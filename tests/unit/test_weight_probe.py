"""A base push's probe (rollout_farm/services/weights/probe.py): computed by the pusher, carried in the first bucket,
scored on staged weights without changing the served ones.

score_staged is the replica's scoring of staged base weights: the served model's forward pass with the staged tensors
in place of its parameters. It must agree with the pusher's compute_probe on a model that holds those weights, leave
the served model as it was, and (tied embeddings) let the staged embedding drive the tied output head too."""

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rollout_farm.services.errors import Invalid
from rollout_farm.services.weights import probe as probes
from rollout_farm.services.weights.buckets import buckets, full_payloads, size
from rollout_farm.services.weights.checks import parse_header
from rollout_farm.services.weights.manifest import manifest_of
from rollout_farm.services.weights.pusher import compute_probe
from rollout_farm.services.weights.state_dict import canonical_state_dict

SEQUENCES = [[1, 5, 9, 2, 7, 30, 4], [3, 3, 8, 1]]


def llama(seed: int, tied: bool = False) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=40,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("tied", [False, True])
def test_staged_weights_score_as_the_pusher_computed_and_the_served_ones_do_not_change(tied):
    served, pushed = llama(0, tied), llama(1, tied)
    before = {n: t.clone() for n, t in canonical_state_dict(served).items()}
    staged = {n: t.clone() for n, t in canonical_state_dict(pushed).items()}
    if tied:
        assert "lm_head.weight" not in staged  # the canonical names leave the tied head out
    probe = probes.parse(compute_probe(pushed, SEQUENCES, tolerance=1e-5))
    probes.check(probe, probes.score_staged(served, staged, SEQUENCES), "r1")  # agrees within 1e-5
    assert all(torch.equal(before[n], t) for n, t in canonical_state_dict(served).items())  # nothing swapped in
    # negative control: the served model's own logprobs are not the pushed weights'
    with pytest.raises(Invalid) as e:
        probes.check(probe, probes.parse(compute_probe(served, SEQUENCES)).logprobs, "r1")
    (detail,) = e.value.detail
    assert detail["field"] == "probe" and "replica r1" in detail["message"] and "sequence" in detail["message"]


def test_a_stale_tied_head_is_what_the_probe_catches():
    """The issue's engine bug: the embedding reloaded, the tied head left as it was. Scoring the staged embedding
    with the old head (a module whose tie was broken) differs from the pusher's logprobs."""
    served, pushed = llama(0, tied=True), llama(1, tied=True)
    staged = {n: t.clone() for n, t in canonical_state_dict(pushed).items()}
    probe = probes.parse(compute_probe(pushed, SEQUENCES, tolerance=1e-4))
    served.lm_head.weight = torch.nn.Parameter(served.lm_head.weight.detach().clone())  # untied: stale head
    with pytest.raises(Invalid):
        probes.check(probe, probes.score_staged(served, staged, SEQUENCES), "r1")


def test_compute_probe_runs_in_eval_mode_and_restores_the_mode():
    model = llama(0).train()
    model.config.attention_dropout = 0.5
    a, b = compute_probe(model, SEQUENCES), compute_probe(model, SEQUENCES)
    assert a == b and model.training
    assert a["sequences"] == SEQUENCES and [len(x) for x in a["logprobs"]] == [7, 4] and a["logprobs"][0][0] is None


def test_the_probe_travels_in_the_first_bucket_only():
    tensors = {f"t{i}": torch.full((64,), float(i)) for i in range(4)}
    probe = json.dumps(compute_probe(llama(0), SEQUENCES))
    body = [bytes(p) for p in buckets(full_payloads(tensors), manifest_of(tensors), 300, probe)]
    assert sum(map(len, body)) == size(full_payloads(tensors), manifest_of(tensors), 300, probe)
    heads = [parse_header(p[8:]) for p in body if len(p) >= 8 and int.from_bytes(p[:8], "little") == len(p) - 8]
    assert len(heads) >= 2 and heads[0][2][probes.META_KEY] == probe
    assert all(probes.META_KEY not in h[2] for h in heads[1:])
    assert probes.parse(heads[0][2][probes.META_KEY]).tolerance == probes.DEFAULT_TOLERANCE


def test_a_malformed_probe_names_its_field_and_a_folder_may_hold_one(tmp_path):
    with pytest.raises(Invalid) as e:
        probes.parse(json.dumps({"sequences": [[1, 2]], "logprobs": [[None, float("nan")]]}))
    assert e.value.detail[0]["field"].startswith("probe")
    assert probes.in_folder(tmp_path) is None
    (tmp_path / probes.PATH_FILE).write_text(json.dumps(compute_probe(llama(0), SEQUENCES)))
    assert probes.in_folder(tmp_path).sequences == SEQUENCES
    (tmp_path / probes.PATH_FILE).write_text("{not json")
    with pytest.raises(Invalid) as e:
        probes.in_folder(tmp_path)
    assert e.value.detail[0]["field"].startswith("probe")


@pytest.mark.parametrize(
    "scored, refused",
    [
        ([[None, -1.0, -2.0]], False),  # as the pusher computed
        ([[None, -1.0, -2.0 + 5e-5]], False),  # within the tolerance
        ([[None, -1.0, -2.1]], True),  # beyond it
        ([[None, -1.0, float("nan")]], True),  # NaN compares false with everything: it must not pass
        ([[None, -1.0, float("-inf")]], True),
        ([[None, -1.0, None]], True),  # a token the engine did not score
        ([[None, -1.0]], True),  # a sequence scored short
        ([], True),  # nothing scored
    ],
)
def test_only_scores_that_match_pass_a_probe(scored, refused):
    probe = probes.parse({"sequences": [[1, 2, 3]], "logprobs": [[None, -1.0, -2.0]], "tolerance": 1e-4})
    if refused:
        with pytest.raises(Invalid) as e:
            probes.check(probe, scored, "r1")
        assert e.value.detail[0]["field"] == "probe" and "replica r1" in e.value.detail[0]["message"]
    else:
        probes.check(probe, scored, "r1")
