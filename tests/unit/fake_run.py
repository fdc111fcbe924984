"""A stand-in for TrainingRun in unit tests that drive the loop's phases without a service: a seeded linear policy
(4 -> 3) with its AdamW, verl's KL controller, and the counters the loop reads; each test adds what else it needs."""

import random
import types

import torch
from verl.trainer.ppo import core_algos


def fake_run(cfg, client, out=None, **fields) -> types.SimpleNamespace:
    torch.manual_seed(0)  # seeded: the policy's initial weights and every step's random inputs
    policy = torch.nn.Linear(4, 3)
    return types.SimpleNamespace(
        cfg=cfg,
        policy=policy,
        critic=None,
        opt={"actor": torch.optim.AdamW(policy.parameters(), lr=0.1)},
        kl_ctrl=core_algos.get_kl_controller(cfg.algorithm.kl_ctrl),
        mini_batch_size=8,
        step=0,
        version=0,
        generated_tokens=0,
        rank=0,
        out=out,
        rng=random.Random(0),
        client=client,
        last_good=None,
        **fields,
    )
