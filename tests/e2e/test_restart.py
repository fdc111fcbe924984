"""A whole-service restart (`farm serve` stopped, Ray down, then up again on the same state folder): the queue and
the committed version pushed by path survive in the embedded redis-server's append-only file, and the replicas
serve that version."""

from safetensors.torch import load_file, save_file

from rollout_farm.services import protocol as P
from rollout_farm.services.client import FarmClient
from tests.conftest import TOKEN
from tests.e2e.commands import farm_serve, serve_env, stop

GREEDY = P.RolloutRequest(
    prompts=[P.Prompt(text="Q: 12+3\nA:")], n=1, sampling_params=P.SamplingParams(temperature=0, max_new_tokens=8)
)


def test_the_queue_and_the_committed_version_survive_a_restart_of_the_whole_service(tiny_model, tmp_path):
    env = serve_env(tiny_model, tmp_path, replicas="2")
    port = env["FARM_PORT"]
    pushed = tmp_path / "weights-v3"
    pushed.mkdir()
    save_file({k: v * 1.05 for k, v in load_file(tiny_model / "model.safetensors").items()}, pushed / "m.safetensors")
    prompts = [P.Prompt(text=f"Q: {a}+1\nA:", ground_truth=str(a + 1)) for a in range(6)]
    url = f"http://127.0.0.1:{port}"

    proc = farm_serve(env)
    try:
        with FarmClient(url, TOKEN) as c:
            c.wait_ready(timeout_s=180)
            base = c.rollouts(GREEDY).groups[0].samples[0]
            c.push_weights_path(str(pushed), 3)
            served = c.rollouts(GREEDY).groups[0].samples[0]
            assert served.weight_version == 3 and served.logprobs != base.logprobs
            spec = P.QueueSource(
                name="kept", prompts=prompts, n=1, target_groups=2, sampling_params=P.SamplingParams(max_new_tokens=8)
            )
            c.queue_add_source(spec)
            leased = c.queue_pull(P.PullRequest(source="kept", max_groups=1, wait_s=60, lease_s=600)).items
            assert len(leased) == 1
            before = c.queue_sources()[0]
    finally:
        out = stop(proc)
        assert proc.returncode == 0, out[-3000:]

    proc = farm_serve(env)
    try:
        with FarmClient(url, TOKEN) as c:
            c.wait_ready(timeout_s=180)
            version = c.weights_version()
            assert version.version == 3 and set(version.replicas.values()) == {3}  # loaded from the folder
            again = c.rollouts(GREEDY).groups[0].samples[0]
            assert again.weight_version == 3 and again.token_ids == served.token_ids
            assert again.logprobs == served.logprobs
            after = c.queue_sources()[0]
            assert after.name == "kept" and after.leased == 1 and after.acked == before.acked == 0
            acked = {}
            while len(acked) < len(prompts) - 1:  # all but the leased one
                items = c.queue_pull(P.PullRequest(source="kept", max_groups=6, wait_s=60)).items
                assert items, c.queue_sources()
                c.queue_ack([i.item_id for i in items])
                acked.update({i.item_id: i.prompt.text for i in items})
            c.queue_ack([leased[0].item_id])  # the lease held across the restart is still ours to settle
            acked[leased[0].item_id] = leased[0].prompt.text
            assert sorted(acked.values()) == sorted(p.text for p in prompts)  # each prompt once, none lost
            final = c.queue_sources()[0]
            assert final.acked == 6 and final.leased == final.ready == final.pending_prompts == 0
    finally:
        out = stop(proc)
        assert proc.returncode == 0, out[-3000:]
