"""`farm serve` with FARM_ENGINE=vllm, as a process of its own: one command starts the service and its replica's
vLLM server; rollouts come from vLLM; a weight upload is loaded, checked and served as its version; SIGTERM leaves
no process of vLLM behind."""

import os

import psutil
from safetensors.torch import load_file, save

from rollout_farm.services import protocol as P
from rollout_farm.services.client import FarmClient
from tests.conftest import TOKEN
from tests.e2e.commands import farm_serve, serve_env, stop

GROUP = P.RolloutRequest(
    prompts=[P.Prompt(token_ids=[70, 71, 72])],
    n=4,
    sampling_params=P.SamplingParams(temperature=1.0, max_new_tokens=6, seed=3, ignore_eos=True),
)


def vllm_servers(model) -> list[psutil.Process]:
    """The vLLM launchers serving `model` (each leads its server's process group)."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if "farm_vllm_launch.py" in cmd and str(model) in cmd:
            found.append(p)
    return found


def group_members(pgid: int) -> list[int]:
    members = []
    for p in psutil.process_iter(["status"]):
        try:
            if os.getpgid(p.pid) == pgid and p.info["status"] != psutil.STATUS_ZOMBIE:
                members.append(p.pid)
        except (ProcessLookupError, psutil.Error):
            continue
    return members


def test_farm_serve_on_vllm_serves_pushes_and_leaves_nothing_behind(tied_model, tmp_path):
    env = serve_env(tied_model, tmp_path, engine="vllm", replicas="1", vllm_kv_cache_gib="1")
    proc = farm_serve(env)
    groups = []
    try:
        with FarmClient(f"http://127.0.0.1:{env['FARM_PORT']}", TOKEN) as c:
            c.wait_ready(timeout_s=300)
            servers = vllm_servers(tied_model)
            assert len(servers) == 1  # the replica's own vLLM server
            groups = [s.pid for s in servers]
            samples = c.rollouts(GROUP).groups[0].samples
            assert len(samples) == 4 and all(len(s.token_ids) == 6 and len(s.logprobs) == 6 for s in samples)
            assert all(s.weight_version == 0 for s in samples)
            weights = load_file(tied_model / "model.safetensors")
            c.push_weights(save({k: v * 1.05 if v.ndim == 2 else v for k, v in weights.items()}), 1)
            assert c.weights_version().version == 1
            again = c.rollouts(GROUP).groups[0].samples
            assert all(s.weight_version == 1 for s in again)
            assert [s.logprobs for s in again] != [s.logprobs for s in samples]  # other weights, other logprobs
    finally:
        out = stop(proc)
    assert proc.returncode == 0, out[-3000:]
    assert groups and all(group_members(pgid) == [] for pgid in groups), "vLLM's processes outlived farm serve"
    assert vllm_servers(tied_model) == []
