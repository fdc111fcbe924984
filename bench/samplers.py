"""Samplers against `plain` on the embedded task (arith problems, the arith-tiny model), in one run.

Part 1, equal token budget. At two policies (the initial model, and the one plain GRPO reaches after
--steps steps, seed 0) every sampler draws groups of n=8 from the same stream of training prompts until
the engines have generated --budget tokens; every candidate, rejected sample, filtered group and cancelled
call counts (the replicas' own token counters). Reported: reward std of the delivered samples, the share
of informative groups (reward std > 0), useful samples (in informative groups) per 1000 generated tokens.

Part 2, training. --steps steps of GRPO (32 prompts x 8 samples per step, as `farm demo`) per sampler and
seed, then greedy accuracy on the held-out split; mean and spread over --seeds seeds.

    .venv/bin/python bench/samplers.py                 # writes docs/data/samplers.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import TOKEN, log, start_service, stop_service, table, write_json  # noqa: E402
from rollout_farm.services.extensions.tasks import TASKS  # noqa: E402

PATTERN = r" ?#### -?[0-9]+"  # the answer line the reward wants, and nothing else (arith's answers need no chain)
CONFIGS = {  # name -> (sampler spec, prompts sent per group kept)
    "plain": ({"name": "plain"}, 1.0),
    "kl_adaptive_temperature": ({"name": "kl_adaptive_temperature"}, 1.0),
    "importance_resampling": ({"name": "importance_resampling", "params": {"beta": 1.0}}, 1.0),
    "pattern_conditional": (
        {"name": "pattern_conditional", "params": {"mode": "constrained", "pattern": PATTERN}},
        1.0,
    ),
    "pattern_filter": ({"name": "pattern_conditional", "params": {"mode": "filter", "pattern": PATTERN}}, 1.0),
    "dynamic_group_filter": ({"name": "dynamic_group_filter"}, 2.0),
}
N, PROMPTS = 8, 16


def engine_tokens(url: str) -> int:
    return sum(r["generated_tokens"] for r in httpx.get(f"{url}/readyz", timeout=60).json()["replicas"])


def budget_run(url: str, name: str, budget: int) -> dict:
    """Draw groups with one sampler until the engines have spent `budget` tokens; statistics of what was delivered."""
    spec, over = CONFIGS[name]
    task, rng = TASKS.get("arith")(), random.Random(0)  # the same prompt stream for every sampler
    start, groups = engine_tokens(url), []
    while engine_tokens(url) - start < budget:
        problems = task.train_batch(rng, int(PROMPTS * over))
        sampler = json.loads(json.dumps(spec))
        if sampler["name"] == "dynamic_group_filter":
            sampler["params"] = {"target_groups": PROMPTS}
        req = {
            "prompts": [{"text": p.prompt, "ground_truth": p.answer} for p in problems],
            "n": N,
            "reward": "gsm8k",
            "sampler": sampler,
            "sampling_params": {"max_new_tokens": task.max_new_tokens, "seed": rng.getrandbits(31)},
        }
        r = httpx.post(f"{url}/v1/rollouts", json=req, timeout=600)
        r.raise_for_status()
        groups += [g for g in r.json()["groups"] if g["samples"]]
    spent = engine_tokens(url) - start
    rewards = [s["reward"] for g in groups for s in g["samples"]]
    informative = [g for g in groups if g["reward_std"] > 1e-6]
    return {
        "sampler": name,
        "tokens": spent,
        "groups": len(groups),
        "samples": len(rewards),
        "reward_mean": statistics.fmean(rewards),
        "reward_std": statistics.pstdev(rewards),
        "informative_fraction": len(informative) / max(1, len(groups)),
        "useful_per_1k_tokens": 1000 * sum(len(g["samples"]) for g in informative) / spent,
    }


def train(url: str, name: str, seed: int, steps: int, eval_size: int, out: Path) -> dict:
    from rollout_farm.trainer import loop
    from rollout_farm.trainer.config import load
    from rollout_farm.trainer.run import TrainingRun

    spec, over = CONFIGS[name]
    folder = out / f"{name}-seed{seed}"
    cfg = load(
        None,
        [
            f"trainer.service_url={url}",
            "actor_rollout_ref.model.path=arith-tiny",
            f"trainer.total_training_steps={steps}",
            f"trainer.eval_size={eval_size}",
            f"trainer.seed={seed}",
            f"actor_rollout_ref.rollout.sampler={spec['name']}",
            f"actor_rollout_ref.rollout.sampler_params={json.dumps(spec.get('params', {}))}",
            f"data.oversample={over}",
            f"trainer.default_local_dir={folder}",
            "trainer.resume_mode=disable",
        ],
    )
    t = time.perf_counter()
    trainer = TrainingRun(cfg, TOKEN)
    summary = loop.train(trainer)
    steps_log = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return {
        "sampler": name,
        "seed": seed,
        "before": summary["before"]["accuracy"],
        "after": summary["after"]["accuracy"],
        "reward_std": statistics.fmean(m["reward_std"] for m in steps_log),
        "reward_mean": statistics.fmean(m["reward_mean"] for m in steps_log),
        "generated_tokens": trainer.generated_tokens,
        "seconds": time.perf_counter() - t,
    }


def spread(xs: list[float]) -> str:
    return f"{statistics.fmean(xs):.3f} ± {statistics.stdev(xs) if len(xs) > 1 else 0:.3f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget", type=int, default=30_000, help="generated tokens per sampler and policy (part 1)")
    ap.add_argument("--steps", type=int, default=30, help="training steps per run (part 2)")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--eval-size", type=int, default=1000, help="held-out problems (capped by the split: 416)")
    ap.add_argument("--samplers", default=",".join(CONFIGS), help="comma-separated subset of: " + ", ".join(CONFIGS))
    a = ap.parse_args()
    names = a.samplers.split(",")
    out = Path("runs/bench-samplers")
    url = start_service(model="arith-tiny")
    budget, runs = {"initial": [], "trained": []}, []
    try:
        httpx.post(
            f"{url}/v1/policy_stats",
            json={"kl": 0.0, "reward_var": 0.0, "step": 0},
            headers={"Authorization": f"Bearer {TOKEN}"},
        )
        for name in names:
            budget["initial"].append(budget_run(url, name, a.budget))
            log(f"budget initial {name}: {budget['initial'][-1]}")
        for seed in range(a.seeds):
            for name in names:
                runs.append(train(url, name, seed, a.steps, a.eval_size, out))
                log(f"trained {name} seed {seed}: {runs[-1]}")
                if seed == 0 and name == names[0]:  # the service now serves this run's final weights
                    for other in names:
                        budget["trained"].append(budget_run(url, other, a.budget))
                        log(f"budget trained {other}: {budget['trained'][-1]}")
    finally:
        stop_service()
    for policy, rows in budget.items():
        base = next(r for r in rows if r["sampler"] == names[0])
        print(f"\nPart 1, equal budget of {a.budget} generated tokens, {policy} policy ({names[0]} is the baseline)")
        print(
            table(
                [
                    "sampler",
                    "tokens",
                    "groups",
                    "reward mean",
                    "reward std",
                    "std vs base",
                    "var vs base",
                    "informative",
                    "useful/1k tok",
                ],
                [
                    [
                        r["sampler"],
                        r["tokens"],
                        r["groups"],
                        r["reward_mean"],
                        r["reward_std"],
                        f"{r['reward_std'] / base['reward_std'] - 1:+.1%}" if base["reward_std"] else "n/a",
                        f"{(r['reward_std'] / base['reward_std']) ** 2 - 1:+.1%}" if base["reward_std"] else "n/a",
                        r["informative_fraction"],
                        r["useful_per_1k_tokens"],
                    ]
                    for r in rows
                ],
            )
        )
    print(f"\nPart 2, {a.steps} training steps, {a.seeds} seeds: held-out greedy accuracy (mean ± std over seeds)")
    rows = []
    for name in names:
        rs = [r for r in runs if r["sampler"] == name]
        rows.append(
            [
                name,
                spread([r["after"] for r in rs]),
                spread([r["after"] - r["before"] for r in rs]),
                spread([r["reward_std"] for r in rs]),
                spread([r["generated_tokens"] / 1000 for r in rs]),
                spread([r["seconds"] for r in rs]),
            ]
        )
    print(table(["sampler", "accuracy after", "gain", "train reward std", "k tokens generated", "seconds"], rows))
    write_json(
        "samplers",
        {
            "budget_tokens": a.budget,
            "steps": a.steps,
            "seeds": a.seeds,
            "pattern": PATTERN,
            "configs": CONFIGS,
            "part1": budget,
            "part2": runs,
        },
    )


if __name__ == "__main__":
    main()
