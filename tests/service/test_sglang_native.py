"""SGLang's native HTTP surface on the farm, with plain httpx requests in SGLang's documented schema (sglang 0.5.14
io_struct.py / http_server.py): /generate, the reads, and the control routes over the same state."""

import json
import shutil
import uuid

import httpx
import pytest
import torch

from tests.service.helpers import (
    AUTH,
    LONG_TOKENS,
    any_busy,
    greedy,
    in_thread,
    replicas,
    rollout,
    versions,
    wait_until,
)

GREEDY = {"temperature": 0, "max_new_tokens": 8}


def generate(service: str, body: dict, timeout: float = 300) -> httpx.Response:
    return httpx.post(f"{service}/generate", json=body, timeout=timeout)


def ok(r: httpx.Response):
    assert r.status_code == 200, r.text
    return r.json()


def test_single_and_batch_generate_with_text_and_input_ids(service):
    one = ok(generate(service, {"input_ids": [40, 41, 42], "sampling_params": GREEDY}))
    assert set(one) == {"text", "output_ids", "meta_info"} and len(one["output_ids"]) >= 1
    meta = one["meta_info"]
    assert meta["prompt_tokens"] == 3 and meta["completion_tokens"] == len(one["output_ids"])
    assert meta["finish_reason"]["type"] in ("stop", "length") and isinstance(meta["weight_version"], str)
    assert "output_token_logprobs" not in meta
    batch = ok(generate(service, {"input_ids": [[40, 41, 42], [43, 44]], "sampling_params": GREEDY}))
    assert isinstance(batch, list) and len(batch) == 2 and batch[0]["output_ids"] == one["output_ids"]
    assert batch[1]["meta_info"]["prompt_tokens"] == 2
    texts = ok(generate(service, {"text": ["hello", "Q: 1+1"], "sampling_params": GREEDY}))
    assert len(texts) == 2 and all(isinstance(a["text"], str) for a in texts)
    assert ok(generate(service, {"text": "hello", "sampling_params": GREEDY}))["output_ids"] == texts[0]["output_ids"]
    n = ok(generate(service, {"text": "hello", "sampling_params": {**GREEDY, "temperature": 1, "n": 3}}))
    assert isinstance(n, list) and len(n) == 3


def test_output_logprobs_equal_the_farms_own_rollout_logprobs(service):
    prompt = [40, 41, 42]
    r = ok(generate(service, {"input_ids": prompt, "sampling_params": GREEDY, "return_logprob": True}))
    farm = rollout(service, greedy([prompt], max_new_tokens=8)).json()["groups"][0]["samples"][0]
    entries = r["meta_info"]["output_token_logprobs"]
    assert [e[1] for e in entries] == r["output_ids"] == farm["token_ids"]
    assert [e[0] for e in entries] == pytest.approx(farm["logprobs"], abs=1e-5)
    assert all(len(e) == 3 and e[2] is None for e in entries)
    assert r["meta_info"]["input_token_logprobs"] == []  # logprob_start_len -1: no prompt logprobs
    with_text = ok(
        generate(
            service,
            {"input_ids": prompt, "sampling_params": GREEDY, "return_logprob": True, "return_text_in_logprobs": True},
        )
    )
    assert all(isinstance(e[2], str) for e in with_text["meta_info"]["output_token_logprobs"])


def test_input_and_top_logprobs_match_a_plain_forward_pass(service, fresh_weights, tiny_model):
    from transformers import AutoModelForCausalLM

    prompt = [40, 41, 42, 43, 44]
    body = {
        "input_ids": prompt,
        "sampling_params": {"temperature": 0, "max_new_tokens": 4},
        "return_logprob": True,
        "logprob_start_len": 0,
        "top_logprobs_num": 3,
    }
    meta = ok(generate(service, body))["meta_info"]
    ids = prompt + [e[1] for e in meta["output_token_logprobs"]]
    model = AutoModelForCausalLM.from_pretrained(tiny_model, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    inputs = meta["input_token_logprobs"]
    assert [e[1] for e in inputs] == prompt and inputs[0][0] is None
    assert [e[0] for e in inputs[1:]] == pytest.approx([lp[i - 1, prompt[i]].item() for i in range(1, 5)], abs=1e-4)
    tops = meta["output_top_logprobs"]
    assert len(tops) == len(meta["output_token_logprobs"]) and all(len(t) == 3 for t in tops)
    first = 5 - 1  # the first output token is predicted at the last prompt position
    want = torch.topk(lp[first], 3)
    assert [e[1] for e in tops[0]] == want.indices.tolist()
    assert [e[0] for e in tops[0]] == pytest.approx(want.values.tolist(), abs=1e-4)
    assert len(meta["input_top_logprobs"]) == 5 and meta["input_top_logprobs"][0] is None


def test_stop_strings_trim_the_text_and_name_the_match(service):
    free = ok(generate(service, {"input_ids": [40, 41, 42], "sampling_params": {**GREEDY, "max_new_tokens": 16}}))
    text = free["text"]
    stop = text.strip()[1:3] if len(text.strip()) >= 3 else None
    if not stop:
        pytest.skip(f"the tiny model's greedy text is too short to stop in: {text!r}")
    params = {**GREEDY, "max_new_tokens": 16, "stop": [stop]}
    r = ok(generate(service, {"input_ids": [40, 41, 42], "sampling_params": params}))
    assert r["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert stop not in r["text"] and text.startswith(r["text"])
    assert len(r["output_ids"]) <= len(free["output_ids"])


def test_rid_names_the_answers(service):
    one = ok(generate(service, {"input_ids": [40, 41], "sampling_params": GREEDY, "rid": "sg-rid-1"}))
    assert one["meta_info"]["id"] == "sg-rid-1"
    batch = ok(generate(service, {"input_ids": [[40], [41]], "sampling_params": GREEDY, "rid": "sg-rid-2"}))
    assert [a["meta_info"]["id"] for a in batch] == ["sg-rid-2_0", "sg-rid-2_1"]
    listed = ok(generate(service, {"input_ids": [[40], [41]], "sampling_params": GREEDY, "rid": ["a-1", "b-2"]}))
    assert [a["meta_info"]["id"] for a in listed] == ["a-1", "b-2"]
    assert len({a["meta_info"]["id"] for a in ok(generate(service, {"input_ids": [[40], [41]]}))}) == 2


def test_stream_is_sglang_sse_ending_with_done(service):
    with httpx.stream(
        "POST", f"{service}/generate", json={"input_ids": [40, 41], "sampling_params": GREEDY, "stream": True}
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [x for x in r.iter_lines() if x]
    assert lines[-1] == "data: [DONE]" and all(x.startswith("data: ") for x in lines)
    chunk = json.loads(lines[0][len("data: ") :])
    assert chunk["output_ids"] and chunk["meta_info"]["finish_reason"]["type"] in ("stop", "length")


@pytest.mark.parametrize(
    "body, field",
    [
        ({"input_ids": [40], "sampling_params": {"min_p": 0.1}}, "min_p"),
        ({"input_ids": [40], "sampling_params": {"frequency_penalty": 0.5}}, "frequency_penalty"),
        ({"input_ids": [40], "lora_path": "bad name!"}, "lora_path"),  # not an adapter name (one: test_adapter_routes)
        ({"input_ids": [40], "image_data": "x"}, "image_data"),
        ({"input_ids": [40], "top_logprobs_num": 50, "return_logprob": True}, "top_logprobs_num"),
        ({"input_ids": [[40], [41]], "rid": ["same", "same"]}, "rid"),
    ],
)
def test_unsupported_fields_are_422_naming_them(service, body, field):
    r = generate(service, body)
    assert r.status_code == 422, r.text
    assert any(field in d["field"] for d in r.json()["detail"]), r.text


def test_model_and_server_info(service, tiny_model):
    info = ok(httpx.get(f"{service}/get_model_info", timeout=30))
    assert info["model_path"] == str(tiny_model) and info["is_generation"] is True
    assert info["weight_version"] == str(versions(service)["version"]) and info["model_type"] == "llama"
    server = ok(httpx.get(f"{service}/get_server_info", timeout=30))
    assert server["dp_size"] == 2 and len(server["internal_states"]) == 2 and server["version"]
    assert ok(httpx.get(f"{service}/model_info", timeout=30))["model_path"] == info["model_path"]
    assert httpx.get(f"{service}/health", timeout=60).status_code == 200
    assert httpx.get(f"{service}/health_generate", timeout=60).status_code == 200


@pytest.mark.parametrize(
    "path, body",
    [
        ("/update_weights_from_disk", {"model_path": "/nowhere"}),
        ("/init_weights_update_group", {"master_address": "x", "master_port": 1, "rank_offset": 1, "world_size": 2}),
        ("/update_weights_from_distributed", {"names": ["a"], "dtypes": ["float32"], "shapes": [[1]]}),
        ("/pause_generation", {}),
        ("/continue_generation", {}),
        ("/flush_cache", None),
        ("/abort_request", {"rid": "x"}),
    ],
)
def test_control_needs_the_token(service, path, body):
    r = httpx.post(f"{service}{path}", json=body, timeout=30)
    assert r.status_code == 401, r.text
    r = httpx.post(f"{service}{path}", json=body, headers={"Authorization": "Bearer wrong"}, timeout=30)
    assert r.status_code == 401, r.text


def test_update_weights_from_disk_bumps_weight_version(service, tiny_model, tmp_path):
    folder = tmp_path / "sglang-disk"  # the test service sets no FARM_WEIGHTS_DIR: any readable folder
    folder.mkdir()
    shutil.copy(tiny_model / "model.safetensors", folder / "model.safetensors")
    before = int(ok(generate(service, {"input_ids": [40], "sampling_params": GREEDY}))["meta_info"]["weight_version"])
    r = httpx.post(f"{service}/update_weights_from_disk", json={"model_path": str(folder)}, headers=AUTH, timeout=300)
    assert ok(r)["success"] is True and r.json()["num_paused_requests"] == 0
    after = ok(generate(service, {"input_ids": [40], "sampling_params": GREEDY}))["meta_info"]["weight_version"]
    assert after == str(before + 1)
    explicit = {"model_path": str(folder), "weight_version": str(before + 3), "abort_all_requests": True}
    assert ok(httpx.post(f"{service}/update_weights_from_disk", json=explicit, headers=AUTH, timeout=300))["success"]
    assert ok(httpx.get(f"{service}/get_model_info", timeout=30))["weight_version"] == str(before + 3)
    stale = {"model_path": str(folder), "weight_version": str(before + 3)}
    assert httpx.post(f"{service}/update_weights_from_disk", json=stale, headers=AUTH, timeout=60).status_code == 409
    bad = {"model_path": str(folder), "weight_version": "step-7"}
    r = httpx.post(f"{service}/update_weights_from_disk", json=bad, headers=AUTH, timeout=60)
    assert r.status_code == 422 and r.json()["detail"][0]["field"] == "weight_version"
    r = httpx.post(f"{service}/update_weights_from_disk", json={**bad, "is_async": True}, headers=AUTH, timeout=60)
    assert r.status_code == 422 and "is_async" in r.text


def test_nccl_routes_answer_501_on_the_torch_engine(service):
    group = {"master_address": "127.0.0.1", "master_port": 29999, "rank_offset": 1, "world_size": 3}
    r = httpx.post(f"{service}/init_weights_update_group", json=group, headers=AUTH, timeout=60)
    assert r.status_code == 501, r.text
    update = {"names": ["lm_head.weight"], "dtypes": ["float32"], "shapes": [[1, 1]]}
    r = httpx.post(f"{service}/update_weights_from_distributed", json=update, headers=AUTH, timeout=60)
    assert r.status_code == 501, r.text


def test_pause_and_continue_generation(service):
    try:
        r = httpx.post(f"{service}/pause_generation", json={}, headers=AUTH, timeout=60)
        assert ok(r) == {"message": "Generation paused successfully.", "status": "ok"}
        assert all(s["paused"] for s in ok(httpx.get(f"{service}/get_server_info", timeout=30))["internal_states"])
        assert httpx.get(f"{service}/health_generate", timeout=60).status_code == 503
        r = httpx.post(f"{service}/pause_generation", json={"mode": "sideways"}, headers=AUTH, timeout=60)
        assert r.status_code == 422 and r.json()["detail"][0]["field"] == "mode"
    finally:
        r = httpx.post(f"{service}/continue_generation", json={}, headers=AUTH, timeout=60)
    assert ok(r)["status"] == "ok"
    assert httpx.get(f"{service}/health_generate", timeout=60).status_code == 200
    assert ok(generate(service, {"input_ids": [40], "sampling_params": GREEDY}))["output_ids"]


def test_flush_cache_and_abort_request(service):
    assert httpx.post(f"{service}/flush_cache", headers=AUTH, timeout=30).status_code == 200
    assert httpx.post(f"{service}/abort_request", json={"rid": "nobody"}, headers=AUTH, timeout=30).status_code == 200
    r = httpx.post(f"{service}/abort_request", json={"abort_all": True}, headers=AUTH, timeout=30)
    assert r.status_code == 200


# partial rollouts (slime's partial rollout, APRIL): abort keeps the tokens, pause holds the running requests ---------
# 2 * LONG_TOKENS (the most a sample may have): a cut seen while it runs has seconds to land (left to chance: a stall
# of the machine that long between the tokens seen and the cut)
CUT_TOKENS = 2 * LONG_TOKENS
SEEDED = {"temperature": 1.0, "max_new_tokens": CUT_TOKENS, "ignore_eos": True, "sampling_seed": 11}


def control(service: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{service}{path}", json=body, headers=AUTH, timeout=120)


def running_generate(service: str, body: dict):
    """A /generate sent from a thread, once a replica decodes it: (thread, [response])."""
    wait_until(lambda: not any_busy(service), "replicas idle before the test")
    steps = sum(s["decode_steps"] for s in replicas(service))
    t, out = in_thread(lambda: generate(service, body))
    wait_until(
        lambda: sum(s["decode_steps"] for s in replicas(service)) >= steps + 5, "a replica decoding: some tokens"
    )
    return t, out


def test_abort_request_answers_with_the_tokens_so_far_the_prefix_of_an_unaborted_run(service):
    """Left to chance: the abort landing within the ~5 s of CUT_TOKENS tokens after some are seen."""
    rid = f"sg-abort-{uuid.uuid4().hex}"
    body = {"input_ids": [40, 41, 42], "sampling_params": SEEDED, "return_logprob": True, "rid": rid}
    t, out = running_generate(service, body)
    assert control(service, "/abort_request", {"rid": rid}).status_code == 200
    t.join(120)
    cut = ok(out[0])
    meta = cut["meta_info"]
    assert meta["finish_reason"]["type"] == "abort" and meta["id"] == rid
    k = len(cut["output_ids"])
    assert 0 < k < CUT_TOKENS and meta["completion_tokens"] == k and len(meta["output_token_logprobs"]) == k
    whole = {"input_ids": [40, 41, 42], "sampling_params": {**SEEDED, "max_new_tokens": k}, "return_logprob": True}
    plain = ok(generate(service, whole))  # the same seed, not aborted, as long as the cut one got
    assert plain["meta_info"]["finish_reason"]["type"] == "length" and plain["output_ids"] == cut["output_ids"]
    lps = [e[0] for e in meta["output_token_logprobs"]]
    assert lps == pytest.approx([e[0] for e in plain["meta_info"]["output_token_logprobs"]], abs=1e-4)
    assert meta["weight_versions"] == [{"version": meta["weight_version"], "start": 0, "end": k}]
    again = ok(generate(service, body))  # the rid's record holds the cut answer: a repeat replays it
    assert again["output_ids"] == cut["output_ids"]


def test_in_place_pause_weight_push_and_continue_switch_versions_at_the_pause(service, tiny_model, tmp_path):
    """An SGLang client's weight sync: pause in place, push by path, continue; the held request finishes under the
    new version, and meta_info.weight_versions says where it switched. Left to chance: the pause landing within the
    ~4 s of its 3000 tokens after some are seen."""
    folder = tmp_path / "held-push"
    folder.mkdir()
    shutil.copy(tiny_model / "model.safetensors", folder / "model.safetensors")
    body = {"input_ids": [44, 45], "sampling_params": {**SEEDED, "max_new_tokens": 3000}, "return_logprob": True}
    t, out = running_generate(service, body)
    try:
        assert ok(control(service, "/pause_generation", {"mode": "in_place"}))["status"] == "ok"
        states = ok(httpx.get(f"{service}/get_server_info", timeout=30))["internal_states"]
        assert all(s["paused"] for s in states) and any(s["busy"] for s in states)  # held, not ended
        pushed = ok(control(service, "/update_weights_from_disk", {"model_path": str(folder)}))
        assert pushed["success"] and not out  # the held request waits
    finally:
        assert ok(control(service, "/continue_generation", {}))["status"] == "ok"
    t.join(300)
    meta = ok(out[0])["meta_info"]
    new = ok(httpx.get(f"{service}/get_model_info", timeout=30))["weight_version"]
    assert meta["finish_reason"]["type"] == "length" and meta["completion_tokens"] == 3000
    spans = meta["weight_versions"]
    assert [s["version"] for s in spans] == [str(int(new) - 1), new], spans
    assert spans[0]["start"] == 0 and 0 < spans[0]["end"] == spans[1]["start"] < spans[1]["end"] == 3000


def test_retract_pause_and_continue_finish_the_request(service):
    body = {"input_ids": [46, 47], "sampling_params": {**SEEDED, "max_new_tokens": 800}}
    t, out = running_generate(service, body)
    try:
        assert ok(control(service, "/pause_generation", {"mode": "retract"}))["status"] == "ok"
        states = ok(httpx.get(f"{service}/get_server_info", timeout=30))["internal_states"]
        assert all(s["paused"] and not s["busy"] for s in states)  # back in the queue, out of the batch
    finally:
        ok(control(service, "/continue_generation", {}))
    t.join(300)
    alone = ok(generate(service, body))
    cut = ok(out[0])
    assert cut["meta_info"]["finish_reason"]["type"] == "length" and cut["output_ids"] == alone["output_ids"]


def test_pause_modes_that_hold_are_501_on_an_engine_that_cannot(bench_service):
    try:
        r = control(bench_service, "/pause_generation", {"mode": "in_place"})
        assert r.status_code == 501 and "in_place" in r.text, r.text
    finally:
        control(bench_service, "/continue_generation", {})
