"""Trainer checkpoints: everything a resumed run needs, written atomically.

A checkpoint is a folder `step_<N>/` under `<dir>/checkpoints/`:
  policy.safetensors, critic.safetensors   weights (safetensors: no pickle for tensors)
  optim.pt                                 optimizer states (torch.save of plain tensors and numbers; loaded
                                           with weights_only)
  state.json                               step, weight version, KL controller value, RNG states, config
It is written to `step_<N>.tmp/` and renamed into place, then `latest` (a text file, also replaced by
rename) names it, so a crash at any moment leaves the previous checkpoint intact and `latest` valid.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from rollout_farm.services.weights.state_dict import canonical_state_dict, cpu_state_dict


def _rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def _state_to_json(state: dict) -> dict:
    py = state["python"]
    np_state = state["numpy"]
    return {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
        "torch": state["torch"].tolist(),
    }


def _state_from_json(d: dict) -> dict:
    py = d["python"]
    np_state = d["numpy"]
    return {
        "python": (py[0], tuple(py[1]), py[2]),
        "numpy": (np_state[0], np.array(np_state[1], dtype=np.uint32), *np_state[2:]),
        "torch": torch.tensor(d["torch"], dtype=torch.uint8),
    }


def save(
    root: Path,
    step: int,
    policy: torch.nn.Module,
    optimizers: dict[str, torch.optim.Optimizer],
    state: dict,
    critic: torch.nn.Module | None = None,
    trainer_rng: random.Random | None = None,
    keep: int = 2,
) -> Path:
    """Write checkpoint `step` atomically and point `latest` at it; keep the newest `keep`."""
    base = root / "checkpoints"
    base.mkdir(parents=True, exist_ok=True)
    final, tmp = base / f"step_{step}", base / f"step_{step}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_file(cpu_state_dict(policy), tmp / "policy.safetensors")
    if critic is not None:
        save_file(cpu_state_dict(critic), tmp / "critic.safetensors")
    torch.save({name: opt.state_dict() for name, opt in optimizers.items()}, tmp / "optim.pt")
    rng = _state_to_json(_rng_state())
    if trainer_rng is not None:
        st = trainer_rng.getstate()
        rng["trainer"] = [st[0], list(st[1]), st[2]]
    (tmp / "state.json").write_text(json.dumps({**state, "step": step, "rng": rng}))
    for f in tmp.iterdir():  # on disk before the rename makes the checkpoint visible
        with f.open("rb") as fh:
            os.fsync(fh.fileno())
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    latest_tmp = base / "latest.tmp"
    latest_tmp.write_text(final.name)
    os.replace(latest_tmp, base / "latest")
    for old in sorted(
        (p for p in base.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp")), key=lambda p: int(p.name[5:])
    )[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest(root: Path) -> Path | None:
    pointer = root / "checkpoints" / "latest"
    if not pointer.exists():
        return None
    path = root / "checkpoints" / pointer.read_text().strip()
    return path if (path / "state.json").exists() else None


def load(
    path: Path,
    policy: torch.nn.Module,
    optimizers: dict[str, torch.optim.Optimizer],
    critic: torch.nn.Module | None = None,
    trainer_rng: random.Random | None = None,
    rngs: bool = True,
) -> dict:
    """Restore weights, optimizers and (unless rngs=False) RNG states from a checkpoint folder; returns its
    state.json."""
    with torch.no_grad():
        params = canonical_state_dict(policy)
        for name, t in load_file(path / "policy.safetensors").items():
            params[name].copy_(t)
        if critic is not None and (path / "critic.safetensors").exists():
            cparams = canonical_state_dict(critic)
            for name, t in load_file(path / "critic.safetensors").items():
                cparams[name].copy_(t)
    # on the CPU: load_state_dict moves them to the params' device
    states = torch.load(path / "optim.pt", weights_only=True, map_location="cpu")
    for name, opt in optimizers.items():
        if name in states:
            opt.load_state_dict(states[name])
    state = json.loads((path / "state.json").read_text())
    if not rngs:
        return state
    rng = _state_from_json(state["rng"])
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    torch.set_rng_state(rng["torch"])
    if trainer_rng is not None and "trainer" in state["rng"]:
        t = state["rng"]["trainer"]
        trainer_rng.setstate((t[0], tuple(t[1]), t[2]))
    return state
