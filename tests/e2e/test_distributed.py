"""Data-parallel training on 2 CPU processes (gloo): the summed gradients equal a single process's on the same batch."""

import os

import pytest
import torch
import torch.multiprocessing as mp

from rollout_farm.services.net import free_port
from tests.e2e.commands import farm_train


def _batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 100, (6, 10), generator=g)
    mask = torch.ones(6, 10)
    mask[1, 7:] = 0
    mask[4, 3:] = 0  # uneven lengths: token-mean needs the global token count
    return ids, mask


def _model(path):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def _loss_sum(model, ids, mask):
    logits = model(input_ids=ids, attention_mask=mask.long()).logits[:, :-1]
    nll = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none"
    ).view(ids.shape[0], -1)
    return (nll * mask[:, 1:]).sum()


def _worker(rank, world, port, path, out):
    from rollout_farm.trainer import distributed

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank))
    assert distributed.init_from_env() == (rank, world)
    model = _model(path)
    ids, mask = _batch()
    rows = list(range(rank, len(ids), world))
    total_tokens = distributed.all_reduce_sum(mask[rows, 1:].sum().clone())
    (_loss_sum(model, ids[rows], mask[rows]) / total_tokens).backward()
    distributed.sum_gradients(model)
    if rank == 0:
        torch.save({n: p.grad for n, p in model.named_parameters()}, out)
    torch.distributed.destroy_process_group()


def test_two_gloo_processes_compute_the_single_process_gradients(tiny_model, tmp_path):
    out = tmp_path / "grads.pt"
    mp.spawn(_worker, args=(2, free_port(), str(tiny_model), str(out)), nprocs=2, join=True)
    model = _model(tiny_model)
    ids, mask = _batch()
    (_loss_sum(model, ids, mask) / mask[:, 1:].sum()).backward()
    ddp = torch.load(out, weights_only=True)
    for name, p in model.named_parameters():
        assert torch.allclose(ddp[name], p.grad, atol=1e-6, rtol=1e-4), name
    assert any(p.grad.abs().sum() > 0 for p in model.parameters())


def test_the_trainer_on_two_gloo_processes_takes_the_single_process_step(service, tiny_model, tmp_path):
    """`torchrun --nproc-per-node 2 -m rollout_farm.trainer.cli train` against the real service: rank 0 pulls and
    broadcasts the batch, each rank trains half of every mini-batch's groups. From the same weights and seed, its step
    logs the same losses and gradient norm as a single process."""
    import json
    import subprocess
    import sys

    from tests.conftest import TOKEN

    def run(folder, *launcher):
        cmd = farm_train(
            service,
            tiny_model,
            *"--task arith --steps 1 --train-batch-size 4 --ppo-mini-batch-size 2 --lr 0.01 --seed 3 --out".split(),
            str(folder),
            *"trainer.reward=test_float_ties actor_rollout_ref.rollout.n=4".split(),
            launcher=launcher,
        )  # not --n: torchrun would take it for one of its own
        done = subprocess.run(
            cmd,
            env={**os.environ, "FARM_API_TOKEN": TOKEN, "OMP_NUM_THREADS": "1"},
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads((folder / "metrics.jsonl").read_text().splitlines()[-1])

    single = run(tmp_path / "single", sys.executable)
    dp = run(tmp_path / "dp", sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2")
    assert dp["world_size"] == 2 and single["world_size"] == 1
    for key in ("pg_loss", "kl_ref", "entropy", "grad_norm", "reward_mean"):
        assert dp[key] == pytest.approx(single[key], rel=1e-3, abs=1e-5), key
