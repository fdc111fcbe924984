"""The design material's four claims, measured on the embedded task (arith, arith-tiny), in one run.

Five configurations, --seeds seeds each, the same number of samples per step delivered to the trainer (32 prompts x 8):
  baseline          plain GRPO: the plain sampler at temperature 1, grpo advantages (what `farm demo` runs)
  baseline_rloo     the same with RLOO advantages, in reward units as control_variate's (GRPO's are standardised)
  grpo_adaptive_kl  baseline plus k1 KL in the reward with the adaptive controller aiming at 0.01: the claim about
                    reward std names adaptive KL alone
  variance_reduced  the design's recipe: kl_adaptive_temperature sampling (0.7 -> 0.5 above KL 0.02), the
                    control_variate estimator (critic + leave-one-out baseline), and that adaptive KL
  filter_cv         the same estimator and KL control, with dynamic_group_filter sampling instead (the sampler that
                    trained best in docs/results.md): 64 prompts sent per step, the first 32 informative groups kept;
                    it generates more than it delivers, which the generated-tokens column counts
Every --test-freq steps the held-out split (416 problems) is scored greedily. Reported per configuration,
mean and spread over seeds: advantage variance, reward std, KL, steps to reach --target accuracy, final
accuracy; PNG plots of reward, KL, advantage variance and accuracy against step.

    .venv/bin/pip install -c requirements.lock -e '.[bench]'   # matplotlib, for the plots
    .venv/bin/python bench/claims.py                             # about 35 min
It writes bench/results/claims.json and docs/img/claims_*.png.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import ROOT, TOKEN, log, start_service, stop_service, table, write_json  # noqa: E402

# k1 KL in the reward, adaptive controller. verl updates the coefficient by
# 1 + clip(kl/target - 1, +-0.2) * samples/horizon per step: with 256 samples a step, horizon 1000 moves it
# up to 5% a step (100 made it grow 1.5x a step and blow up)
ADAPTIVE_KL = [
    "algorithm.use_kl_in_reward=true",
    "algorithm.kl_penalty=k1",
    "algorithm.kl_ctrl.type=adaptive",
    "algorithm.kl_ctrl.target_kl=0.01",
    "algorithm.kl_ctrl.horizon=1000",
]
CV = "algorithm.adv_estimator=control_variate"
CONFIGS = {
    "baseline": [],
    "baseline_rloo": [
        "algorithm.adv_estimator=rloo"
    ],  # advantages in reward units, like control_variate's: their variances compare
    "grpo_adaptive_kl": ADAPTIVE_KL,
    "variance_reduced": ["actor_rollout_ref.rollout.sampler=kl_adaptive_temperature", CV, *ADAPTIVE_KL],
    "filter_cv": ["actor_rollout_ref.rollout.sampler=dynamic_group_filter", "data.oversample=2", CV, *ADAPTIVE_KL],
}
PLOTS = {
    "reward_mean": "reward (mean over the batch)",
    "kl_ref": "KL to the reference",
    "adv_var": "advantage variance",
    "val_accuracy": "held-out accuracy",
}


def run(url: str, name: str, seed: int, a, out: Path) -> list[dict]:
    from trainer.config import load
    from trainer.loop import train
    from trainer.run import TrainingRun

    folder = out / f"{name}-seed{seed}"
    cfg = load(
        None,
        [
            f"trainer.service_url={url}",
            "actor_rollout_ref.model.path=arith-tiny",
            f"trainer.total_training_steps={a.steps}",
            f"trainer.eval_size={a.eval_size}",
            f"trainer.test_freq={a.test_freq}",
            f"trainer.seed={seed}",
            f"trainer.default_local_dir={folder}",
            "trainer.resume_mode=disable",
            *CONFIGS[name],
        ],
    )
    t = time.perf_counter()
    train(TrainingRun(cfg, TOKEN))
    log(f"{name} seed {seed}: {time.perf_counter() - t:.0f} s")
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def summarise(steps: list[dict], target: float) -> dict:
    evals = [(s["step"], s["val_accuracy"]) for s in steps if "val_accuracy" in s]
    return {
        "adv_var": statistics.fmean(s["adv_var"] for s in steps),
        "reward_std": statistics.fmean(s["reward_std"] for s in steps),
        "kl": statistics.fmean(s["kl_ref"] for s in steps),
        "generated_ktokens": steps[-1]["generated_tokens"] / 1000,
        "final_accuracy": evals[-1][1] if evals else float("nan"),
        "steps_to_target": next((step for step, acc in evals if acc >= target), None),
    }


def spread(xs: list[float]) -> str:
    xs = [x for x in xs if x is not None]
    if not xs:
        return "never"
    return f"{statistics.fmean(xs):.4g} ± {statistics.stdev(xs):.2g}" if len(xs) > 1 else f"{xs[0]:.4g}"


def plot(runs: dict[str, list[list[dict]]], folder: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for key, label in PLOTS.items():
        fig, ax = plt.subplots(figsize=(6, 3.6))
        for (name, seeds), color in zip(runs.items(), ("tab:blue", "tab:green", "tab:orange", "tab:purple", "tab:red")):
            for i, steps in enumerate(seeds):
                pts = [(s["step"], s[key]) for s in steps if key in s]
                ax.plot(
                    [p[0] for p in pts], [p[1] for p in pts], color=color, alpha=0.8, label=name if i == 0 else None
                )
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        ax.legend()
        ax.grid(alpha=0.3)
        fig.tight_layout()
        paths.append(folder / f"claims_{key}.png")
        fig.savefig(paths[-1], dpi=100)
        plt.close(fig)
    return paths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--test-freq", type=int, default=5)
    ap.add_argument("--eval-size", type=int, default=1000, help="held-out problems (capped by the split: 416)")
    ap.add_argument("--target", type=float, default=0.3, help="held-out accuracy for 'steps to target'")
    a = ap.parse_args()
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        sys.exit("the plots need matplotlib: .venv/bin/pip install -c requirements.lock -e '.[bench]'")
    url = start_service(model="arith-tiny")
    runs: dict[str, list[list[dict]]] = {name: [] for name in CONFIGS}
    try:
        for seed in range(a.seeds):
            for name in CONFIGS:
                runs[name].append(run(url, name, seed, a, ROOT / "runs" / "bench-claims"))
    finally:
        stop_service()
    summary = {name: [summarise(s, a.target) for s in seeds] for name, seeds in runs.items()}
    rows = []
    for name, per_seed in summary.items():
        rows.append(
            [
                name,
                *(
                    spread([s[k] for s in per_seed])
                    for k in ("adv_var", "reward_std", "kl", "generated_ktokens", "final_accuracy")
                ),
                spread([s["steps_to_target"] for s in per_seed])
                + f" ({sum(s['steps_to_target'] is not None for s in per_seed)}/{len(per_seed)} reached)",
            ]
        )
    print(f"\n{a.steps} steps, {a.seeds} seeds, 32 prompts x 8 samples per step; mean ± std over seeds")
    print(
        table(
            [
                "config",
                "advantage variance",
                "reward std",
                "KL to reference",
                "k tokens generated",
                "final held-out accuracy",
                f"steps to {a.target:.2f}",
            ],
            rows,
        )
    )
    paths = plot(runs, ROOT / "docs" / "img")
    write_json(
        "claims",
        {
            "steps": a.steps,
            "seeds": a.seeds,
            "target": a.target,
            "configs": CONFIGS,
            "summary": summary,
            "runs": runs,
            "plots": [str(p.relative_to(ROOT)) for p in paths],
        },
    )


if __name__ == "__main__":
    main()
