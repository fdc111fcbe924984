"""The Python client and the `farm` command line against the real service."""

import hashlib
import json
import shutil
import threading
import time

import httpx
import pytest

from rollout_farm.services import protocol as P
from rollout_farm.services.client import AsyncFarmClient, FarmClient, FarmError
from rollout_farm.services.client import calls as farm_client  # CHUNK_BYTES, the upload slices
from rollout_farm.trainer import cli
from tests.conftest import TOKEN
from tests.service.helpers import replicas, wait_until


def greedy(k: int = 2, **kw) -> P.RolloutRequest:
    """k prompts, greedy. Streams stay at 2 prompts: a stream splits into replicas * 2 parts, and more than 2 parts
    at once overflow this config's FARM_ENGINE_MAX_QUEUED_REQUESTS=2 (the stream then ends with a 429-like error)."""
    prompts = [P.Prompt(text=f"Q: {i}+{i}\nA:", ground_truth=str(2 * i)) for i in range(k)]
    return P.RolloutRequest(
        prompts=prompts, n=2, sampling_params=P.SamplingParams(temperature=0.0, max_new_tokens=6), reward="gsm8k", **kw
    )


def tokens(groups: list[P.Group]) -> list[list[list[int]]]:
    return [[s.token_ids for s in g.samples] for g in groups]


def test_push_weights_sends_checksummed_slices_with_a_length(client, fresh_weights, tiny_model, monkeypatch):
    data = (tiny_model / "model.safetensors").read_bytes()
    monkeypatch.setattr(farm_client, "CHUNK_BYTES", 64 << 10)  # the tiny model in 11 slices
    sent = []
    client.http.event_hooks["request"] = [sent.append]
    pushed = client.push_weights(data, fresh_weights + 1, policy="abort")
    assert pushed.version == fresh_weights + 1 == client.weights_version().version and pushed.bytes == len(data)
    headers = sent[0].headers
    assert headers["content-length"] == str(len(data)) and "transfer-encoding" not in headers
    assert headers["x-content-sha256"] == hashlib.sha256(data).hexdigest() and sent[0].url.params["policy"] == "abort"


def test_a_wrong_checksum_is_refused(service, client, fresh_weights, tiny_model):
    data = (tiny_model / "model.safetensors").read_bytes()
    headers = {"Authorization": f"Bearer {TOKEN}", "x-content-sha256": hashlib.sha256(data + b"x").hexdigest()}
    r = httpx.post(f"{service}/v1/weights", params={"version": fresh_weights + 1}, content=data, headers=headers)
    assert r.status_code == 422 and r.json()["detail"][0]["field"] == "x-content-sha256"
    assert client.weights_version().version == fresh_weights


def test_a_retried_push_sends_the_whole_body_again(service, client, fresh_weights, tiny_model, monkeypatch):
    data = (tiny_model / "model.safetensors").read_bytes()
    monkeypatch.setattr(farm_client, "CHUNK_BYTES", 64 << 10)
    with FarmClient(service, TOKEN, retries=1, backoff_s=0.01) as c:
        send = c.http.request

        def drop_first(*a, **kw):  # the first attempt reads one slice, then loses its connection
            drop_first.calls += 1
            if drop_first.calls == 1:
                next(iter(kw["content"]))
                raise httpx.ConnectError("connection dropped")
            return send(*a, **kw)

        drop_first.calls = 0
        c.http.request = drop_first
        assert c.push_weights(data, fresh_weights + 1).bytes == len(data)
    assert drop_first.calls == 2 and client.weights_version().version == fresh_weights + 1


def test_push_weights_path(client, fresh_weights, tiny_model, tmp_path):
    shutil.copy(tiny_model / "model.safetensors", tmp_path)
    pushed = client.push_weights_path(tmp_path, fresh_weights + 1, policy="partial")
    assert pushed.version == fresh_weights + 1 == client.weights_version().version and pushed.tensors > 0
    with pytest.raises(FarmError) as e:
        client.push_weights_path(tmp_path / "nothing", fresh_weights + 2)
    assert e.value.status == 422 and "no *.safetensors" in str(e.value.body)


def test_stream_yields_each_group_once_as_a_plain_call_gives_it(client, fresh_weights):
    plain = client.rollouts(greedy(request_id="stream-vs-plain"))
    events = list(client.rollouts_stream(greedy()))
    assert sorted(e.index for e in events) == [0, 1]
    streamed = [g for _, g in sorted((e.index, e.group) for e in events)]
    assert tokens(streamed) == tokens(plain.groups)  # greedy: the same tokens, however the service splits the prompts
    assert all(s.weight_version == fresh_weights for g in streamed for s in g.samples)
    replayed = {
        e.index: e.group for e in client.rollouts_stream(greedy(request_id="stream-vs-plain"))
    }  # a replay of the first result
    assert [replayed[0], replayed[1]] == plain.groups


async def test_async_stream_push_and_samplers(service, fresh_weights, tiny_model):
    async with AsyncFarmClient(service, TOKEN, retries=0) as c:
        events = [e async for e in c.rollouts_stream(greedy())]
        assert sorted(e.index for e in events) == [0, 1] and all(len(e.group.samples) == 2 for e in events)
        pushed = await c.push_weights((tiny_model / "model.safetensors").read_bytes(), fresh_weights + 1)
        assert pushed.version == (await c.weights_version()).version == fresh_weights + 1
        assert "plain" in await c.samplers()
        assert not (await c.cancel("no-such-request")).cancelled


LONG_TOKENS = 4000  # a rollout the cancel reaches first, whichever ingress replica takes it (the owner acts at its
# next heartbeat, within a second; 16 samples of 400 tokens can finish sooner on the tiny model)


def wait_for_idle_engines(service: str) -> None:
    """Until no replica runs or holds a rollout: the tests before may leave parts still winding down (a cancelled
    part frees its rows at the next decode step; a part waiting for a weight version, at its deadline)."""
    wait_until(
        lambda: all(s["rollouts_running"] == s["rollouts_waiting"] == 0 for s in replicas(service)),
        "the engine replicas idle (a rollout part never ended)",
        timeout_s=60,
    )


def cancel_when_running(client: FarmClient, request_id: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not client.cancel(request_id).cancelled:
        assert time.monotonic() < deadline, f"{request_id} never ran"
        time.sleep(0.02)


def test_samplers_and_cancel(client):
    assert "plain" in client.samplers()
    assert client.cancel("no-such-request") == P.CancelResponse(request_id="no-such-request", cancelled=False)
    long = P.RolloutRequest(
        prompts=[P.Prompt(text="hi")] * 4,
        n=4,
        request_id="to-cancel",
        sampling_params=P.SamplingParams(max_new_tokens=LONG_TOKENS, ignore_eos=True),
    )
    failed = []
    thread = threading.Thread(target=lambda: failed.append(pytest.raises(FarmError, client.rollouts, long)))
    thread.start()
    cancel_when_running(client, "to-cancel")
    thread.join(60)
    assert failed and failed[0].value.status == 409 and "cancelled" in failed[0].value.body["error"]


def test_a_stream_that_fails_raises_farm_error(client, fresh_weights):
    with pytest.raises(FarmError) as e:  # nobody pushes this version: the stream ends with the 409's message
        list(client.rollouts_stream(greedy(min_weight_version=10**6)))
    assert "FARM_MIN_VERSION_WAIT_S" in e.value.body["error"]


def test_a_cancelled_stream_raises_farm_error(service, fresh_weights):
    long = P.RolloutRequest(
        prompts=[P.Prompt(text="hi")] * 4,  # long enough that the cancel lands first, whichever replica takes it
        n=4,
        request_id="stream-to-cancel",
        sampling_params=P.SamplingParams(max_new_tokens=LONG_TOKENS, ignore_eos=True),
    )
    wait_for_idle_engines(service)  # its 4 parts fill both replicas' slots: a part left over would get it a 429
    ended, cancels = threading.Event(), []

    def cancel_until_ended(client: FarmClient) -> None:
        # Again and again: when Serve routes two parts to one replica the stream gets a 429 and the client sends it
        # again under the same id; a single cancel would have ended only the first try.
        while not ended.wait(0.02):
            cancels.append(client.cancel("stream-to-cancel").cancelled)

    with FarmClient(service, TOKEN, retries=5) as c, FarmClient(service, TOKEN, retries=0) as other:
        canceller = threading.Thread(target=cancel_until_ended, args=(other,))
        canceller.start()
        try:
            with pytest.raises(FarmError) as e:
                list(c.rollouts_stream(long))
        finally:
            ended.set()
            canceller.join()
    assert e.value.status == 409 and "cancelled" in e.value.body["error"] and any(cancels)


def test_queue_source_pull_and_ack(service, client, fresh_weights):
    params = P.SamplingParams(max_new_tokens=4)
    state = client.queue_add_source(
        P.QueueSource(name="client-test", n=2, target_groups=2, sampling_params=params, reward="gsm8k")
    )
    assert state.name == "client-test" and state.pending_prompts == 0
    assert (
        client.queue_add_prompts("client-test", [P.Prompt(text="Q: 1+1\nA:", ground_truth="2")]).name == "client-test"
    )
    jsonl = b'{"text": "Q: 2+2\\nA:", "ground_truth": "4"}\n\n{"token_ids": [40, 41]}\n'
    assert client.queue_upload_jsonl("client-test", jsonl).name == "client-test"
    with pytest.raises(FarmError) as e:
        client.queue_upload_jsonl("client-test", b'{"text": ""}\n')
    assert e.value.status == 422 and e.value.body["detail"][0]["field"].startswith("line 1")
    assert "client-test" in [s.name for s in client.queue_sources()]
    items = []
    while len(items) < 3:
        pulled = client.queue_pull(P.PullRequest(source="client-test", max_groups=3, wait_s=30))
        assert pulled.items, "no group generated within 30 s"
        items += pulled.items
    assert len({i.item_id for i in items}) == 3 and all(len(i.group.samples) == 2 for i in items)
    ids = [i.item_id for i in items]
    assert client.queue_ack(ids).acked == ids
    again = client.queue_ack([ids[0], "client-test:999"])
    assert again.already_acked == [ids[0]] and again.unknown == ["client-test:999"]
    assert client.queue_remove_source("client-test").acked == 3
    with pytest.raises(FarmError) as e:
        client.queue_pull(P.PullRequest(source="client-test"))
    assert e.value.status == 404


def farm(capsys, *args: str) -> tuple[int, str, str]:
    """`farm ARGS` in this process: (exit code, stdout, stderr)."""
    with pytest.raises(SystemExit) as e:
        cli.main(list(args))
    return e.value.code, *capsys.readouterr()


@pytest.fixture
def farm_env(service, monkeypatch):
    monkeypatch.setenv("FARM_URL", service)
    monkeypatch.setenv("FARM_API_TOKEN", TOKEN)
    monkeypatch.setattr(cli, "_setup_logging", lambda: None)  # keep the root logger off pytest's captured stdout


def test_cli_weights_stream_and_cancel(farm_env, capsys, client, fresh_weights, tiny_model, tmp_path):
    code, out, _ = farm(capsys, "weights", "version")
    assert code == 0 and json.loads(out)["version"] == fresh_weights
    shutil.copy(tiny_model / "model.safetensors", tmp_path)
    code, out, _ = farm(capsys, "weights", "push", str(tmp_path), "--policy", "abort")
    assert code == 0 and json.loads(out)["version"] == fresh_weights + 1 == client.weights_version().version
    code, out, _ = farm(
        capsys, "weights", "push", str(tiny_model / "model.safetensors"), "--version", str(fresh_weights + 3)
    )
    assert code == 0 and json.loads(out)["version"] == fresh_weights + 3
    code, out, _ = farm(
        capsys,
        "rollout",
        "--prompt",
        "Q: 1+2\nA:",
        "--prompt",
        "hi",
        "--n",
        "2",
        "--max-new-tokens",
        "4",
        "--stream",
        "--sampler",
        "plain",
        "--min-weight-version",
        str(fresh_weights + 3),
        "--request-id",
        "cli-stream",
    )
    events = [P.GroupEvent.model_validate_json(line) for line in out.splitlines()]
    assert code == 0 and sorted(e.index for e in events) == [0, 1]
    assert all(s.weight_version == fresh_weights + 3 for e in events for s in e.group.samples)
    code, out, _ = farm(capsys, "cancel", "cli-stream")  # finished: nothing to cancel
    assert code == 0 and json.loads(out) == {"request_id": "cli-stream", "cancelled": False}


def test_cli_queue(farm_env, service, capsys, fresh_weights, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"text": "Q: 3+4\\nA:", "ground_truth": "7"}\n{"text": "Q: 5+5\\nA:", "ground_truth": "10"}\n')
    code, out, _ = farm(
        capsys,
        "queue",
        "add",
        "cli-test",
        "--jsonl",
        str(prompts),
        "--n",
        "2",
        "--target-groups",
        "2",
        "--max-new-tokens",
        "4",
        "--reward",
        "gsm8k",
    )
    assert code == 0 and json.loads(out)["name"] == "cli-test"
    code, out, _ = farm(capsys, "queue", "list")
    assert code == 0 and "cli-test" in [s["name"] for s in json.loads(out)]
    code, out, _ = farm(capsys, "queue", "pull", "cli-test", "--max-groups", "2", "--lease-s", "60", "--wait-s", "30")
    items = json.loads(out)["items"]
    assert code == 0 and items and all(len(i["group"]["samples"]) == 2 for i in items)
    code, out, _ = farm(capsys, "queue", "ack", *[i["item_id"] for i in items])
    assert code == 0 and json.loads(out)["acked"] == [i["item_id"] for i in items]
    code, out, _ = farm(capsys, "queue", "remove", "cli-test")
    assert code == 0 and json.loads(out)["acked"] == len(items)
    code, _, err = farm(capsys, "queue", "remove", "cli-test")
    assert code == 1 and "no queue source" in err


async def test_async_client(service, fresh_weights):
    from rollout_farm.services.client import AsyncFarmClient

    async with AsyncFarmClient(service, TOKEN) as c:
        assert (await c.weights_version()).version == fresh_weights
        resp = await c.rollouts(
            P.RolloutRequest(prompts=[P.Prompt(text="hi")], n=3, sampling_params=P.SamplingParams(max_new_tokens=4))
        )
        assert len(resp.groups[0].samples) == 3 and (await c.health()).status == "ok"
