"""Pushes by path and the uploads a farm keeps: the folders each side writes stay bounded, and the trainer's key
trainer.push_dir is refused where it cannot apply. The pushes themselves against the real service:
tests/service/test_weight_pushes.py; a restarted `farm serve`: tests/e2e/test_restart.py."""

import os
import time

import pytest
import torch
from safetensors.torch import load_file

from rollout_farm.services.weights.path_pusher import KEEP, prune, write_version
from rollout_farm.services.weights.store import ORPHAN_AGE_S, sweep
from rollout_farm.trainer.config import ConfigError, load


def test_each_version_is_written_once_and_the_folder_keeps_the_newest_three(tmp_path):
    tensors = {"a": torch.arange(6, dtype=torch.float32).view(2, 3), "b": torch.ones(4)}
    for v in range(1, 6):
        assert write_version(tmp_path, v, {**tensors, "b": tensors["b"] * v}) == (tmp_path / f"v{v}").resolve()
        prune(tmp_path, v)
    (tmp_path / "notes").mkdir()  # not a version's folder: left alone
    prune(tmp_path, 5)
    assert KEEP == 3 and sorted(p.name for p in tmp_path.iterdir()) == ["notes", "v3", "v4", "v5"]
    got = load_file(tmp_path / "v5" / "model.safetensors")
    assert torch.equal(got["a"], tensors["a"]) and torch.equal(got["b"], tensors["b"] * 5)
    write_version(tmp_path, 4, tensors)  # an earlier run's v4: replaced whole
    assert torch.equal(load_file(tmp_path / "v4" / "model.safetensors")["b"], tensors["b"])


def test_a_new_store_deletes_only_old_uploads_no_record_names(tmp_path):
    old = time.time() - ORPHAN_AGE_S - 60
    names = {"kept": "a" * 32, "orphan": "b" * 32, "cut": "c" * 32 + ".partial", "writing": "d" * 32}
    for key, name in names.items():
        (tmp_path / name).mkdir()
        if key != "writing":  # another cluster's push, being written now
            os.utime(tmp_path / name, (old, old))
    (tmp_path / "user-notes").mkdir()  # not a folder the store writes
    os.utime(tmp_path / "user-notes", (old, old))
    sweep(tmp_path, {names["kept"]})
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([names["kept"], names["writing"], "user-notes"])
    sweep(tmp_path, set(), older_than_s=0)  # `farm serve --fresh`: every upload
    assert [p.name for p in tmp_path.iterdir()] == ["user-notes"]


def test_push_dir_is_refused_with_a_mode_that_diffs_uploads():
    for mode in ("bucketed", "delta"):
        with pytest.raises(ConfigError, match=f"trainer.weight_sync: {mode} diffs HTTP uploads"):
            load(None, ["trainer.push_dir=/shared/steps", f"trainer.weight_sync={mode}"])
    # negative controls: alone it loads, and with LoRA too (the adapter goes there by path: rollout_farm/trainer/run.py)
    assert load(None, ["trainer.push_dir=/shared/steps"]).trainer.push_dir == "/shared/steps"
    assert load(None, ["trainer.push_dir=/shared/steps", "actor_rollout_ref.model.lora_rank=8"]).lora
