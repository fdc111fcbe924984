"""A whole-service restart (`farm serve` stopped, Ray down, then up again on the same state folder): the queue and
the committed version survive in the embedded redis-server's append-only file, and the replicas serve that version,
whether it was pushed by path or uploaded (kept under the state folder); `farm serve --fresh` starts at version 0.
One test, four starts of `farm serve` (each start costs CI tens of seconds): each restart checks what the last run
committed, then commits the next thing to check."""

import signal
import threading

from safetensors.torch import load_file, save, save_file

from rollout_farm.services import protocol as P
from rollout_farm.services.client import FarmClient
from tests.conftest import TOKEN
from tests.e2e.commands import farm_serve, serve_env
from tests.service.helpers import wait_until

GREEDY = P.RolloutRequest(
    prompts=[P.Prompt(text="Q: 12+3\nA:")], n=1, sampling_params=P.SamplingParams(temperature=0, max_new_tokens=8)
)
READY = "rollout service ready on"


class Serving:
    """A `farm serve` whose output is read as it comes, so a test awaits its lines ("rollout service ready") instead
    of racing them."""

    def __init__(self, env: dict, *args: str):
        self.proc, self.lines = farm_serve(env, *args), []
        self.url = f"http://127.0.0.1:{env['FARM_PORT']}"
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    def said(self, words: str) -> bool:
        return any(words in line for line in self.lines)

    def wait_for(self, words: str) -> None:
        wait_until(lambda: self.said(words) or self.proc.poll() is not None, f"farm serve printing {words!r}", 300)
        assert self.said(words), "".join(self.lines)[-3000:]

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=120)
        self.reader.join(timeout=30)
        assert self.proc.returncode == 0, "".join(self.lines)[-3000:]


def test_the_queue_and_each_committed_version_survive_a_restart_and_fresh_starts_at_version_0(tiny_model, tmp_path):
    """The issue's new user: `farm serve`, push weights (by path, then over HTTP: the trainer's default transport),
    stop, `farm serve` again on the same model. The folder pushed by path is read again; the upload is kept under the
    state folder by default, so the farm serves it again, and says it is ready only then (a farm that cannot load its
    committed version says why instead: tests/unit/test_serve_readiness.py). A prompt queue keeps its prompts, and a
    lease held across the restart is still its holder's to settle. `--fresh` starts at version 0."""
    env = serve_env(tiny_model, tmp_path, replicas="2")
    uploads = tmp_path / "state" / "uploads"  # FARM_UPLOADS_DIR's default with the embedded Redis
    weights = load_file(tiny_model / "model.safetensors")
    pushed = tmp_path / "weights-v3"
    pushed.mkdir()
    save_file({k: v * 1.05 for k, v in weights.items()}, pushed / "m.safetensors")
    uploaded = {k: v * 0.95 for k, v in weights.items()}
    prompts = [P.Prompt(text=f"Q: {a}+1\nA:", ground_truth=str(a + 1)) for a in range(6)]

    farm = Serving(env)  # version 3 by path, and a queue with one group leased
    try:
        farm.wait_for(READY)
        with FarmClient(farm.url, TOKEN) as c:
            base = c.rollouts(GREEDY).groups[0].samples[0]
            c.push_weights_path(str(pushed), 3)
            by_path = c.rollouts(GREEDY).groups[0].samples[0]
            assert by_path.weight_version == 3 and by_path.logprobs != base.logprobs
            spec = P.QueueSource(
                name="kept", prompts=prompts, n=1, target_groups=2, sampling_params=P.SamplingParams(max_new_tokens=8)
            )
            c.queue_add_source(spec)
            leased = c.queue_pull(P.PullRequest(source="kept", max_groups=1, wait_s=60, lease_s=600)).items
            assert len(leased) == 1
            before = c.queue_sources()[0]
    finally:
        farm.stop()

    farm = Serving(env)  # version 3 from its folder and the queue again; then version 4 by upload
    try:
        farm.wait_for(READY)
        with FarmClient(farm.url, TOKEN) as c:
            version = c.weights_version()
            assert version.version == 3 and set(version.replicas.values()) == {3}  # loaded from the folder
            again = c.rollouts(GREEDY).groups[0].samples[0]
            assert again.weight_version == 3 and again.token_ids == by_path.token_ids
            assert again.logprobs == by_path.logprobs
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
            assert c.push_weights(save(uploaded), 4).version == 4
            by_upload = c.rollouts(GREEDY).groups[0].samples[0]
            assert by_upload.weight_version == 4 and by_upload.logprobs not in (base.logprobs, by_path.logprobs)
    finally:
        farm.stop()
    assert len(list(uploads.iterdir())) == 1

    farm = Serving(env)  # version 4 from the kept upload
    try:
        farm.wait_for(READY)
        with FarmClient(farm.url, TOKEN) as c:
            again = c.rollouts(GREEDY).groups[0].samples[0]
            assert again.weight_version == 4 and again.token_ids == by_upload.token_ids
            assert again.logprobs == by_upload.logprobs
    finally:
        farm.stop()

    farm = Serving(env, "--fresh")
    try:
        farm.wait_for(READY)
        assert list(uploads.iterdir()) == []  # --fresh dropped the kept upload with the state
        with FarmClient(farm.url, TOKEN) as c:
            fresh = c.rollouts(GREEDY).groups[0].samples[0]
            assert fresh.weight_version == 0 and (fresh.token_ids, fresh.logprobs) == (base.token_ids, base.logprobs)
    finally:
        farm.stop()
