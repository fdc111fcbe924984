"""The v1 features over real HTTP against the real service (two replicas, tiny Llama): streaming, cancellation,
min_weight_version, atomic and path pushes, in-flight policies, per-replica versions, samplers, OpenAI logprobs,
and the autoscaling config (no service). The SGLang NCCL test needs GPUs and is skipped elsewhere."""

import hashlib
import json
import shutil
import socket
import threading
import time
import uuid

import httpx
import pytest
import torch
from safetensors.torch import load_file, save, save_file

from tests.conftest import MIN_VERSION_WAIT_S, TOKEN

AUTH = {"Authorization": f"Bearer {TOKEN}"}
LONG_TOKENS = 2048  # a few seconds of decoding for the tiny model on one core: long enough to act on while it runs


# helpers ---------------------------------------------------------------------------------------------------------

def in_thread(fn):
    """Run fn in a thread; its return value (or exception) lands in the returned list."""
    out: list = []

    def run():
        try:
            out.append(fn())
        except Exception as e:  # surfaced by the test's assertions
            out.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def wait_until(cond, what: str, timeout_s: float = 120.0):
    """Poll cond until it holds; fail naming `what` after a generous deadline (a hang, not a timing check)."""
    deadline = time.monotonic() + timeout_s
    while not (value := cond()):
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.05)
    return value


def replicas(service: str) -> list[dict]:
    r = httpx.get(f"{service}/readyz", timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["replicas"]


def any_busy(service: str) -> bool:
    return any(s["busy"] for s in replicas(service))


def versions(service: str) -> dict:
    return httpx.get(f"{service}/v1/weights/version", timeout=30).json()


def replica_metric(service: str, name: str) -> dict[str, float]:
    """replica id -> value of a per-replica Prometheus gauge."""
    out = {}
    for line in httpx.get(f"{service}/metrics", timeout=30).text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line.rsplit(" ", 1)
            out[labels.split('replica="', 1)[1].split('"', 1)[0]] = float(value)
    return out


def push(service: str, data: bytes, version: int, policy: str | None = None, headers: dict | None = None) -> httpx.Response:
    params = {"version": version, **({"policy": policy} if policy else {})}
    return httpx.post(f"{service}/v1/weights", params=params, content=data, headers={**AUTH, **(headers or {})}, timeout=300)


def push_path(service: str, folder, version: int) -> httpx.Response:
    return httpx.post(f"{service}/v1/weights/path", json={"path": str(folder), "version": version}, headers=AUTH, timeout=300)


def rollout(service: str, body: dict, timeout: float = 300) -> httpx.Response:
    return httpx.post(f"{service}/v1/rollouts", json=body, timeout=timeout)


def greedy(prompts: list[list[int]], max_new_tokens: int = 12, n: int = 1, **extra) -> dict:
    return {"prompts": [{"token_ids": p} for p in prompts], "n": n,
            "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens, **extra}}


def long_rollout(n: int = 2, prompts: int = 1, max_new_tokens: int = LONG_TOKENS, **extra) -> dict:
    return greedy([[40 + i, 41, 42] for i in range(prompts)], max_new_tokens, n, ignore_eos=True, **extra)


def perturbed(tiny_model, seed: int, scale: float = 0.5) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return {k: v + scale * torch.randn_like(v) for k, v in load_file(tiny_model / "model.safetensors").items()}


def tokens(resp: httpx.Response) -> list[list[int]]:
    assert resp.status_code == 200, resp.text
    return [s["token_ids"] for g in resp.json()["groups"] for s in g["samples"]]


# 1. streaming ------------------------------------------------------------------------------------------------------

def test_stream_sends_each_group_once_then_an_end_line_and_matches_the_plain_answer(service):
    body = greedy([[40 + i, 50, 60, 70] for i in range(2)], max_new_tokens=10)  # equal lengths: no padding differences
    plain = rollout(service, body).json()["groups"]
    with httpx.stream("POST", f"{service}/v1/rollouts", json={**body, "stream": True}, timeout=300) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in r.iter_lines() if line]
    events, end = lines[:-1], lines[-1]
    assert (end["done"], end["groups"], end["error"]) == (True, 2, None) and set(end) <= {"done", "groups", "error", "status", "filter"}
    assert sorted(e["index"] for e in events) == list(range(2))
    for e in events:
        assert set(e) == {"index", "group"}
        assert e["group"]["prompt_token_ids"] == [40 + e["index"], 50, 60, 70]
        assert [s["token_ids"] for s in e["group"]["samples"]] == [s["token_ids"] for s in plain[e["index"]]["samples"]]


# 2. cancellation ---------------------------------------------------------------------------------------------------

def _generated(service: str) -> float:
    return sum(replica_metric(service, "farm_replica_generated_tokens").values())


def test_delete_cancels_a_running_rollout_and_frees_the_engines(service):
    wait_until(lambda: not any_busy(service), "replicas idle before the test")
    before, rid = _generated(service), f"cancel-{uuid.uuid4().hex}"
    body = {**long_rollout(n=8, max_new_tokens=4096), "request_id": rid}  # one group: one replica call (see the saturation test)
    t, out = in_thread(lambda: rollout(service, body))
    wait_until(lambda: any_busy(service), "a replica busy with the rollout")
    r = httpx.delete(f"{service}/v1/rollouts/{rid}", headers=AUTH, timeout=30)
    assert r.status_code == 200 and r.json() == {"request_id": rid, "cancelled": True}
    t.join(120)
    assert out and out[0].status_code == 409 and "cancelled" in out[0].json()["error"]
    wait_until(lambda: not any_busy(service), "every replica idle after the cancel")
    generated = _generated(service) - before
    assert 0 < generated < 8 * 4096 / 2  # the partial work was counted; most of the 32768 tokens were never made
    assert httpx.delete(f"{service}/v1/rollouts/{rid}", headers=AUTH, timeout=30).json()["cancelled"] is False  # gone, not running


def test_delete_of_a_streamed_rollout_ends_the_stream_with_an_error(service):
    wait_until(lambda: not any_busy(service), "replicas idle before the test")
    rid = f"cancel-stream-{uuid.uuid4().hex}"
    body = {**long_rollout(n=2, prompts=1, max_new_tokens=4096), "request_id": rid, "stream": True}

    def read_stream():
        with httpx.stream("POST", f"{service}/v1/rollouts", json=body, timeout=300) as r:
            return r.status_code, [json.loads(line) for line in r.iter_lines() if line]

    t, out = in_thread(read_stream)
    wait_until(lambda: any_busy(service), "a replica busy with the rollout")
    assert httpx.delete(f"{service}/v1/rollouts/{rid}", headers=AUTH, timeout=30).json()["cancelled"] is True
    t.join(120)
    assert out and not isinstance(out[0], Exception), f"the stream broke instead of ending with a StreamEnd line: {out!r}"
    status, lines = out[0]
    end = lines[-1] if lines else {}
    assert status == 200 and end.get("done") is True and end["groups"] == 0 and "cancelled" in end["error"], lines
    assert end.get("status", 409) == 409
    wait_until(lambda: not any_busy(service), "every replica idle after the cancel")


def post_and_drop(service: str, body: dict) -> None:
    """POST a rollout on a plain socket and close it once a replica is busy with it: a real FIN at a known moment."""
    raw = json.dumps(body).encode()
    host, port = service.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/rollouts HTTP/1.1\r\nHost: farm\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(raw) + raw)
        wait_until(lambda: any_busy(service), "a replica busy with the rollout")
        sock.shutdown(socket.SHUT_RDWR)


def test_closing_the_connection_cancels_a_plain_rollout(service):
    wait_until(lambda: not any_busy(service), "replicas idle before the test")
    before = _generated(service)
    post_and_drop(service, long_rollout(n=8, max_new_tokens=4096))
    wait_until(lambda: not any_busy(service), "every replica idle after the client left")
    assert 0 < _generated(service) - before < 8 * 4096 / 2


def test_a_retry_after_a_dropped_connection_picks_up_the_running_rollout(service):
    """With a request_id, a caller whose connection drops (say its read timed out) has FARM_DISCONNECT_GRACE_S to send
    the request again: the retry gets the running job's result, and nothing is generated twice. Without a retry, the
    work is cancelled once the grace period is over."""
    wait_until(lambda: not any_busy(service), "replicas idle before the test")
    body = {**long_rollout(n=4), "request_id": "dropped-then-retried"}
    replays = lambda: next(float(line.split()[-1]) for line in httpx.get(f"{service}/metrics", timeout=30).text.splitlines()  # noqa: E731
                           if line.startswith("farm_idempotent_replays_total "))
    before, replayed = _generated(service), replays()
    post_and_drop(service, body)
    r = rollout(service, body, timeout=300)
    assert r.status_code == 200 and [len(s["token_ids"]) for s in r.json()["groups"][0]["samples"]] == [LONG_TOKENS] * 4
    assert replays() == replayed + 1  # the retry joined the first job
    assert 4 * LONG_TOKENS <= _generated(service) - before < 4 * LONG_TOKENS + 64  # generated once (plus /readyz's one-token health checks)
    before = _generated(service)
    post_and_drop(service, {**long_rollout(n=8, max_new_tokens=4096), "request_id": "dropped-for-good"})
    wait_until(lambda: not any_busy(service), "every replica idle once the grace period was over")
    assert 0 < _generated(service) - before < 8 * 4096


# 3. min_weight_version ---------------------------------------------------------------------------------------------

def test_rollout_waits_for_min_weight_version_until_it_is_pushed(service, tiny_model):
    current = versions(service)["version"]
    t, out = in_thread(lambda: rollout(service, {**greedy([[40, 41]], max_new_tokens=4), "min_weight_version": current + 1}))
    t.join(0.5)  # give it time to start waiting (the push below must land within FARM_MIN_VERSION_WAIT_S)
    assert push(service, (tiny_model / "model.safetensors").read_bytes(), current + 1).status_code == 200
    t.join(120)
    assert out and out[0].status_code == 200, out
    assert [s["weight_version"] for g in out[0].json()["groups"] for s in g["samples"]] == [current + 1]


def test_min_weight_version_never_pushed_gets_409_naming_the_field(service):
    current = versions(service)["version"]
    r = rollout(service, {**greedy([[40, 41]], max_new_tokens=4), "min_weight_version": current + 5}, timeout=MIN_VERSION_WAIT_S + 120)
    assert r.status_code == 409, r.text
    assert [d["field"] for d in r.json()["detail"]] == ["min_weight_version"] and str(current + 5) in r.json()["error"]
    assert versions(service)["version"] == current


# 4. atomic pushes, path pushes, checksums --------------------------------------------------------------------------

def test_push_every_replica_fails_to_stage_leaves_all_on_the_old_version(service, tiny_model, tmp_path):
    current = versions(service)["version"]
    before = tokens(rollout(service, greedy([[40, 41, 42]])))
    bad = tmp_path / "bad"
    bad.mkdir()
    save_file(perturbed(tiny_model, seed=1), bad / "model.safetensors")
    with open(bad / "model.safetensors", "ab") as f:  # headers stay valid (the ingress checks only those); safetensors refuses the file
        f.write(b"\0" * 64)
    r = push_path(service, bad, current + 1)
    assert r.status_code == 500 and f"every replica stays on version {current}" in r.json()["error"], r.text
    assert len(r.json()["detail"]) == 2  # both replicas said why
    now = versions(service)
    assert now["version"] == current and set(now["replicas"].values()) == {current} and len(now["replicas"]) == 2
    assert tokens(rollout(service, greedy([[40, 41, 42]]))) == before
    good = perturbed(tiny_model, seed=1)  # the same tensors, intact: version current + 1 is still free
    assert push(service, save(good), current + 1).status_code == 200
    assert set(versions(service)["replicas"].values()) == {current + 1}
    assert tokens(rollout(service, greedy([[40, 41, 42]]))) != before


def test_push_from_a_folder_changes_outputs_and_bumps_every_replica(service, tiny_model, tmp_path):
    current = versions(service)["version"]
    original = tmp_path / "original"
    original.mkdir()
    shutil.copy(tiny_model / "model.safetensors", original / "model.safetensors")
    changed = tmp_path / "changed"
    changed.mkdir()
    save_file(perturbed(tiny_model, seed=2), changed / "model.safetensors")
    body = greedy([[40, 41, 42], [43, 44, 45]])

    r = push_path(service, original, current + 1)
    assert r.status_code == 200 and r.json()["version"] == current + 1 and r.json()["tensors"] == len(load_file(original / "model.safetensors"))
    on_original = rollout(service, body)
    assert {s["weight_version"] for g in on_original.json()["groups"] for s in g["samples"]} == {current + 1}
    assert push_path(service, changed, current + 2).status_code == 200
    assert set(versions(service)["replicas"].values()) == {current + 2}
    assert tokens(rollout(service, body)) != tokens(on_original)
    assert push_path(service, original, current + 3).status_code == 200
    assert tokens(rollout(service, body)) == tokens(on_original)  # the folder's weights, exactly


def test_push_from_a_folder_without_safetensors_is_422_naming_path(service, tmp_path):
    current = versions(service)["version"]
    (tmp_path / "model.bin").write_bytes(b"not safetensors")
    for folder in (tmp_path, tmp_path / "missing"):
        r = push_path(service, folder, current + 1)
        assert r.status_code == 422 and [d["field"] for d in r.json()["detail"]] == ["path"], r.text
    assert versions(service)["version"] == current


def test_wrong_content_sha256_is_refused_and_the_right_one_accepted(service, tiny_model):
    current = versions(service)["version"]
    data = (tiny_model / "model.safetensors").read_bytes()
    r = push(service, data, current + 1, headers={"x-content-sha256": hashlib.sha256(b"other").hexdigest()})
    assert r.status_code == 422 and [d["field"] for d in r.json()["detail"]] == ["x-content-sha256"], r.text
    assert versions(service)["version"] == current
    r = push(service, data, current + 1, headers={"x-content-sha256": hashlib.sha256(data).hexdigest().upper()})
    assert r.status_code == 200 and versions(service)["version"] == current + 1


# 5. in-flight policies ---------------------------------------------------------------------------------------------

def _push_during_long_rollout(service, tiny_model, policy: str) -> tuple[int, list[dict]]:
    """Start a long greedy rollout (one group: one replica), push a new version with `policy` while it decodes;
    the old version and the rollout's samples."""
    wait_until(lambda: not any_busy(service), "replicas idle before the test")
    old = versions(service)["version"]
    t, out = in_thread(lambda: rollout(service, long_rollout(n=2)))
    wait_until(lambda: any_busy(service), "a replica busy with the rollout")
    r = push(service, save(perturbed(tiny_model, seed=3, scale=0.1)), old + 1, policy=policy)
    assert r.status_code == 200 and r.json()["version"] == old + 1, r.text
    t.join(300)
    assert out and out[0].status_code == 200, out
    return old, [s for g in out[0].json()["groups"] for s in g["samples"]]


def test_policy_partial_switches_weights_mid_sample(service, tiny_model):
    old, samples = _push_during_long_rollout(service, tiny_model, "partial")
    assert all(s["weight_version"] == old and len(s["token_ids"]) == LONG_TOKENS and s["finish_reason"] == "length" for s in samples)
    mixed = [s["token_weight_versions"] for s in samples if s["token_weight_versions"]]
    assert mixed, "no sample saw the commit"
    for v in mixed:
        assert len(v) == LONG_TOKENS and v[0] == old and v[-1] == old + 1 and v == sorted(v)


def test_policy_abort_reruns_in_flight_samples_on_the_new_weights(service, tiny_model):
    old, samples = _push_during_long_rollout(service, tiny_model, "abort")
    for s in samples:
        assert s["finish_reason"] == "length" and s["weight_version"] == old + 1 and len(s["token_ids"]) == LONG_TOKENS, \
            {k: s[k] for k in ("finish_reason", "weight_version")}
        assert s["token_weight_versions"] is None


def test_policy_finish_lets_in_flight_samples_end_on_the_old_weights(service, tiny_model):
    old, samples = _push_during_long_rollout(service, tiny_model, "finish")
    for s in samples:
        assert s["weight_version"] == old and s["token_weight_versions"] is None and s["finish_reason"] == "length"
    assert set(versions(service)["replicas"].values()) == {old + 1}


def test_an_abort_push_reaches_replicas_whose_request_slots_are_full(service, tiny_model):
    """The fixture allows two ongoing requests per replica: four one-group rollouts fill both replicas. The push's
    stage and commit calls must still reach them, so every sample, the running ones included, ends on the new version."""
    from services import protocol as P
    from services.client import FarmClient

    wait_until(lambda: not any_busy(service), "replicas idle before the test")
    old = versions(service)["version"]
    with FarmClient(service, TOKEN, retries=100, backoff_s=0.05, max_backoff_s=0.5) as c:  # retries the 429s of a full engine queue
        # long enough that the running ones are still running when the push lands, on an idle machine too
        runs = [in_thread(lambda i=i: c.rollouts(P.RolloutRequest.model_validate(greedy([[40 + i, 41]], 2 * LONG_TOKENS, ignore_eos=True)))) for i in range(4)]
        time.sleep(1.5)  # let them take the replicas' slots (not an assertion: a late one simply runs on the new version)
        r = push(service, save(perturbed(tiny_model, seed=4, scale=0.1)), old + 1, policy="abort")
        assert r.status_code == 200, r.text
        for t, _ in runs:
            t.join(300)
    got = [(s.weight_version, s.finish_reason) for _, out in runs for g in out[0].groups for s in g.samples]
    assert got == [(old + 1, "length")] * 4, got


# 6. per-replica versions -------------------------------------------------------------------------------------------

def test_each_replica_reports_its_version_over_http_and_in_metrics(service, tiny_model):
    version = versions(service)["version"] + 1
    assert push(service, (tiny_model / "model.safetensors").read_bytes(), version).status_code == 200
    now = versions(service)
    assert now["version"] == version and len(now["replicas"]) == 2 and set(now["replicas"].values()) == {version}
    assert replica_metric(service, "farm_replica_weight_version") == {rid: float(version) for rid in now["replicas"]}
    assert {s["replica"] for s in replicas(service)} == set(now["replicas"])


# 7. samplers -------------------------------------------------------------------------------------------------------

def test_samplers_are_listed_and_unknown_names_or_params_get_422(service):
    listed = httpx.get(f"{service}/v1/samplers").json()
    assert "plain" in listed and listed["plain"]
    r = rollout(service, {**greedy([[40]]), "sampler": {"name": "nope"}})
    assert r.status_code == 422
    [d] = r.json()["detail"]
    assert d["field"] == "sampler.name" and "plain" in d["message"]
    r = rollout(service, {**greedy([[40]]), "sampler": {"name": "plain", "params": {"x": 1}}})
    assert r.status_code == 422 and [d["field"] for d in r.json()["detail"]] == ["sampler.params.x"]
    assert rollout(service, {**greedy([[40]], max_new_tokens=2), "sampler": {"name": "plain", "params": {}}}).status_code == 200


# 8. OpenAI logprobs ------------------------------------------------------------------------------------------------

def test_completion_logprobs_join_to_the_text_and_match_the_rollout(service, fresh_weights):
    prompt = "Q: 12+3\nA:"
    r = httpx.post(f"{service}/v1/completions", json={"prompt": prompt, "max_tokens": 10, "temperature": 0, "logprobs": 0}, timeout=120)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    assert any(ord(ch) > 127 for ch in choice["text"])  # the tiny model's greedy answer holds a character of two bytes, two tokens
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == 10 and "".join(lp["tokens"]) == choice["text"]
    same = rollout(service, {"prompts": [{"text": prompt}], "sampling_params": {"temperature": 0, "max_new_tokens": 10}}).json()
    assert lp["token_logprobs"] == pytest.approx(same["groups"][0]["samples"][0]["logprobs"], abs=1e-5)
    assert all(x <= 0 for x in lp["token_logprobs"])
    plain = httpx.post(f"{service}/v1/completions", json={"prompt": prompt, "max_tokens": 4, "temperature": 0}, timeout=120).json()
    assert plain["choices"][0]["logprobs"] is None


def test_completion_logprobs_above_zero_get_422(service):
    r = httpx.post(f"{service}/v1/completions", json={"prompt": "hi", "logprobs": 3})
    assert r.status_code == 422 and [d["field"] for d in r.json()["detail"]] == ["logprobs"]


def test_chat_logprobs_list_each_token(service, fresh_weights):
    body = {"messages": [{"role": "user", "content": "Q: 2+2"}], "max_completion_tokens": 8, "temperature": 0, "logprobs": True}
    r = httpx.post(f"{service}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    content = choice["logprobs"]["content"]
    assert len(content) == 8 and all(isinstance(c["token"], str) and c["logprob"] <= 0 for c in content)
    assert "".join(c["token"] for c in content) == choice["message"]["content"]


# 9. autoscaling config (no service) ------------------------------------------------------------------------------

def _deployments(**settings) -> dict[str, dict]:
    """What `serve build` would write for the app: deployment name -> its options as set by build_app."""
    from ray.serve._private.build_app import build_app as serve_build
    from ray.serve.deployment import deployment_to_schema

    from services.app import build_app
    from services.settings import ServiceSettings

    built = serve_build(build_app(ServiceSettings(api_token=TOKEN, **settings)), name="farm")
    return {d.name: deployment_to_schema(d).model_dump(exclude_unset=True) for d in built.deployments}


def test_max_replicas_turns_on_serve_autoscaling():
    engine = _deployments(replicas=1, max_replicas=4, target_ongoing_requests=3)["engine"]
    assert "num_replicas" not in engine
    scaling = engine["autoscaling_config"]
    assert (scaling["min_replicas"], scaling["initial_replicas"], scaling["max_replicas"], scaling["target_ongoing_requests"]) == (1, 1, 4, 3)


@pytest.mark.parametrize("max_replicas", [0, 2])
def test_without_headroom_the_replica_count_is_fixed(max_replicas):
    engine = _deployments(replicas=2, max_replicas=max_replicas)["engine"]
    assert engine["num_replicas"] == 2 and "autoscaling_config" not in engine


# 10. SGLang's NCCL weight transport (GPU) ------------------------------------------------------------------------

@pytest.mark.gpu
def test_sglang_receives_weights_over_nccl_and_bumps_its_version(tmp_path):
    """SGLang engine on cuda:0, a trainer rank on cuda:1 broadcasting a changed lm_head (NCCL needs two devices)."""
    pytest.importorskip("sglang", reason="needs the sglang extra: pip install 'rollout-farm[sglang]'")
    if torch.cuda.device_count() < 2:
        pytest.skip("NCCL needs the trainer and the engine on different GPUs: needs 2")
    from sglang.srt.utils import init_custom_process_group

    from services.engine.sglang_engine import SGLangEngine
    from services.models import tiny_llama
    from services.protocol import SamplingParams
    from tests.conftest import _free_port

    torch.cuda.set_device(1)  # the trainer's rank; SGLang takes GPU 0
    model = tiny_llama(tmp_path / "m", hidden=256, layers=2, seed=0)  # head_dim 64: SGLang's attention kernels support it
    engine = SGLangEngine(str(model), "cuda", "bfloat16")
    try:
        params = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
        before = engine.generate([[40, 41, 42]], params)[0].token_ids
        port = _free_port()
        t, out = in_thread(lambda: engine.init_weights_update_group("127.0.0.1", port, 1, 2, "farm_test", "nccl"))
        group = init_custom_process_group(backend="nccl", init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=0, group_name="farm_test")
        t.join(300)
        assert out == [None]
        head = load_file(model / "model.safetensors")["lm_head.weight"].to("cuda:1", torch.bfloat16)
        head = torch.roll(head, 1, dims=0)  # every logit moves one token id along: greedy tokens change
        t, out = in_thread(lambda: engine.update_weights_from_distributed(["lm_head.weight"], ["BF16"], [list(head.shape)], 7, "farm_test"))
        torch.distributed.broadcast(head, src=0, group=group)
        t.join(300)
        assert out == [None] and engine.weight_version == 7
        after = engine.generate([[40, 41, 42]], params)[0]
        assert after.weight_version == 7 and after.token_ids != before
    finally:
        engine.llm.shutdown()
