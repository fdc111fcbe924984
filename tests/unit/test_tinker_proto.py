"""The Tinker wire, without a service: the hand-written protobuf SampleResponse read back by the `tinker` SDK's own
decoder, Tinker's sampling params as the farm's, model paths as adapter references, and the sample requests the farm
refuses naming the field."""

from __future__ import annotations

import math

import pytest

from rollout_farm.services.compat import tinker_proto
from rollout_farm.services.compat.tinker import adapter_of, farm_params, parsed
from rollout_farm.services.errors import Invalid
from rollout_farm.services.protocol import tinker as T


def test_the_sdk_decodes_what_the_farm_encodes():
    from tinker.proto.response_conv import deserialize_sample_response

    seqs = [([1, 2, 300_000], [-0.5, -1.25, -3.0], "stop"), ([7], [-0.125], "length"), ([5, 6], None, "stop")]
    got = deserialize_sample_response(tinker_proto.sample_response(seqs, [None, -1.5, -2.0]))
    assert [(s.tokens, s.logprobs, s.stop_reason) for s in got.sequences] == seqs
    assert got.prompt_logprobs == [None, -1.5, -2.0]
    assert deserialize_sample_response(tinker_proto.sample_response(seqs[:1])).prompt_logprobs is None


def test_a_logprob_keeps_float32_precision():
    from tinker.proto.response_conv import deserialize_sample_response

    (s,) = deserialize_sample_response(tinker_proto.sample_response([([3], [-1 / 3], "stop")])).sequences
    assert math.isclose(s.logprobs[0], -1 / 3, rel_tol=1e-7)


@pytest.mark.parametrize(
    "stop, strings, ids, ignore_eos",
    [(None, [], [], False), ("\n", ["\n"], [], True), (["a", "b"], ["a", "b"], [], True), ([2, 9], [], [2, 9], True)]
    + [([], [], [], True)],
)
def test_stop_replaces_eos_as_tinkers_does(stop, strings, ids, ignore_eos):
    params = farm_params(T.SamplingParams(stop=stop, max_tokens=5, seed=3, temperature=0.5, top_k=4, top_p=0.8))
    assert (params.stop, params.stop_token_ids, params.ignore_eos) == (strings, ids, ignore_eos)
    assert (params.max_new_tokens, params.seed, params.temperature, params.top_k, params.top_p) == (5, 3, 0.5, 4, 0.8)
    assert farm_params(T.SamplingParams()).max_new_tokens == 128


def test_model_paths_name_an_adapter_version_or_its_newest():
    assert adapter_of("tinker://my-run@v40").model_dump() == {"name": "my-run", "version": 40, "min_version": None}
    assert adapter_of("tinker://my-run").version is None
    with pytest.raises(Invalid) as e:
        parsed(T.CreateSamplingSession, {"session_id": "s", "sampling_session_seq_id": 0, "model_path": "run/x/y"})
    assert e.value.detail[0]["field"] == "model_path"


SAMPLE = {
    "sampling_session_id": "s:sample:0",
    "seq_id": 0,
    "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]},
    "sampling_params": {"temperature": 1.0, "top_k": -1, "top_p": 1.0},
}


@pytest.mark.parametrize(
    "change, field, words",
    [
        ({"topk_prompt_logprobs": 3}, "topk_prompt_logprobs", "not served"),
        ({"topk_sample_logprobs": 1}, "topk_sample_logprobs", "not served"),
        ({"prompt_alt_tokens_k": 2}, "prompt_alt_tokens_k", "not served"),
        ({"record_stability_info": True}, "record_stability_info", "not served"),
        ({"target_prompt_logprobs": {"data": [1]}}, "target_prompt_logprobs", "not served"),
        ({"prompt": {"chunks": [{"type": "image", "data": "", "format": "png"}]}}, "prompt.chunks", "token ids only"),
        ({"sampling_params": {"top_k": 0}}, "sampling_params.top_k", "top_k=0"),
        ({"sampling_params": {"seed": -1}}, "sampling_params.seed", "greater than or equal"),
        ({"sampling_params": {"stop": [""]}}, "sampling_params.stop", "empty"),
        ({"sampling_params": {"min_p": 0.1}}, "sampling_params.min_p", "not a field"),
        ({"num_samples": 65}, "num_samples", "less than or equal"),
    ],
)
def test_what_the_farm_cannot_honour_is_refused_naming_the_field(change, field, words):
    with pytest.raises(Invalid) as e:
        parsed(T.SampleRequest, {**SAMPLE, **change})
    assert e.value.detail[0]["field"] == field and words in e.value.detail[0]["message"]
    assert parsed(T.SampleRequest, SAMPLE).num_samples == 1
