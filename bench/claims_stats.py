"""The claims benchmark's statistics, from bench/claims.py's per-seed files: per-run summaries, comparisons paired by
seed, and each claim's verdict by RULE (a paired t-test and a 95% t interval). bench/claims_report.py renders them.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

NAN = float("nan")
ARM_ORDER = ("grpo", "rloo", "reinforce_plus_plus", "grpo_adaptive_kl", "design_recipe")
DESIGN = "design_recipe"
CLAIMS = {
    1: "custom sampling with variance reduction lowers the reward-signal variance by 15-20%",
    2: "about 5% higher alignment accuracy",
    3: "reward std 0.25 → 0.18 with adaptive KL (target 0.01)",
    4: "1.2× faster convergence",
}
RULE = (
    "Each comparison's effect is computed per seed, from the two runs with that seed, and signed so that the "
    "claimed direction is positive. Over the seeds: its mean, a 95% t interval, and the p-value of a paired "
    "t-test against no effect (`scipy.stats.ttest_rel`). When every seed gives the same effect there is no spread "
    "for a t-test or an interval: p is then an exact sign test's (`scipy.stats.binomtest` on the seeds whose effect "
    "is not zero), and no interval is given. Fewer than 3 seeds are **inconclusive**, with no p. A comparison "
    "**holds** if the whole 95% interval lies at or above the claimed size (without an interval: every seed's "
    "effect does) and p < 0.05; it **fails** if the whole 95% "
    "interval lies below the claimed size, or the effect has the wrong sign with p < 0.05; otherwise it is "
    "**inconclusive**. A claim's verdict is its first comparison's; the others are further readings."
)


def load_runs(data_dir: Path) -> dict[str, dict[int, dict]]:
    """{arm: {seed: the run's record}}, arms in the benchmark's order, seeds ascending."""
    runs: dict[str, dict[int, dict]] = {}
    for path in sorted(Path(data_dir).glob("*.json")):
        record = json.loads(path.read_text())
        runs.setdefault(record["arm"], {})[record["seed"]] = record
    order = sorted(runs, key=lambda a: (ARM_ORDER.index(a) if a in ARM_ORDER else len(ARM_ORDER), a))
    return {arm: dict(sorted(runs[arm].items())) for arm in order}


def finite(*xs) -> bool:
    return all(x is not None and math.isfinite(x) for x in xs)


def mean(xs) -> float:
    xs = [x for x in xs if finite(x)]
    return statistics.fmean(xs) if xs else NAN


def area(points: list[tuple[int, float]]) -> float:
    """The mean height of a curve given at steps: trapezoid area / its span."""
    if len(points) < 2:
        return points[0][1] if points else NAN
    total = sum((s1 - s0) * (a0 + a1) / 2 for (s0, a0), (s1, a1) in zip(points, points[1:]))
    return total / (points[-1][0] - points[0][0])


def steps_to_target(acc: list[tuple[int, float]], target: float) -> float:
    """The first evaluated step from which the held-out accuracy stays at or above `target` to the end of the run
    (converged, not only touched: a rollback can undo a step that reached it); NaN if none."""
    for i, (step, _) in enumerate(acc):
        if all(a >= target for _, a in acc[i:]):
            return step
    return NAN


POLICY_FIGURES = ("val_accuracy", "val_number_accuracy", "kl_ref")  # read from the kept steps only


def kept(steps: list[dict]) -> list[dict]:
    """The steps the guards did not roll back. Before issue 36 the trainer scored and reported a step before its
    guards rolled it back, so a rolled-back step's held-out score and KL are the discarded policy's: the figures of
    the policy are read from these steps (the batch's figures from every step: the kept policy sampled it)."""
    return [s for s in steps if "rollback" not in s.get("guard_actions", [])]


def summarise(run: dict, target: float) -> dict:
    """One run's figures: final scores, means over steps, steps to the target accuracy, guard actions. The held-out
    scores and the KL come from the kept steps only (`kept`)."""
    steps = run["steps"]
    acc = [(s["step"], s["val_accuracy"]) for s in kept(steps) if s.get("val_accuracy") is not None]
    number = [s["val_number_accuracy"] for s in kept(steps) if s.get("val_number_accuracy") is not None]
    actions = [a for s in steps for a in s.get("guard_actions", [])]
    return {
        "accuracy": acc[-1][1] if acc else NAN,
        "number_accuracy": number[-1] if number else NAN,
        "reward_std": mean(s.get("reward_std") for s in steps),
        "reward_var": mean(s["reward_std"] ** 2 for s in steps if "reward_std" in s),
        "kl": mean(s.get("kl_ref") for s in kept(steps)),
        "adv_var": mean(s.get("adv_var") for s in steps),
        "adv_var_rloo": mean(s.get("adv_var_rloo") for s in steps),
        "adv_var_ratio": mean(s["adv_var"] / s["adv_var_rloo"] for s in steps if s.get("adv_var_rloo")),
        "ktokens": steps[-1]["generated_tokens"] / 1000 if steps else NAN,
        "steps_to_target": steps_to_target(acc, target),
        "auc": area(acc),
        "beta": [s["kl_coef"] for s in steps if finite(s.get("kl_coef"))],
        "rollbacks": actions.count("rollback"),
        "raises": actions.count("raise_mini_batch"),
    }


@dataclass
class Comparison:
    claim: int
    what: str  # the per-seed effect, in words
    base: str  # what it is measured against
    treat: str  # what the claim is about
    base_value: float  # means over the paired seeds
    treat_value: float
    effects: list[float]  # one per seed pair, the claimed direction positive
    paired: int  # seeds both sides ran (some may lack the figure: steps to target)
    claimed: float | None  # the claimed size in the effect's units; None: reported, not judged
    percent: bool  # the effect is relative


MIN_SEEDS = 3  # fewer seeds are inconclusive, with no p


@dataclass
class Judged:
    n: int
    mean: float
    lo: float
    hi: float
    p: float
    verdict: str


def judge(effects: list[float], claimed: float | None) -> Judged:
    """Mean, 95% t interval and paired t-test p of the per-seed effects (an exact sign test's p and no interval when
    they do not vary), and the verdict by RULE. No p without a test: fewer than MIN_SEEDS seeds have none."""
    from scipy import stats

    d = [x for x in effects if finite(x)]
    n = len(d)
    if n < MIN_SEEDS:
        return Judged(n, mean(d), NAN, NAN, NAN, "inconclusive" if claimed is not None else "")
    m, sd = statistics.fmean(d), statistics.stdev(d)
    if sd == 0:  # identical effects (steps to target moves in whole evaluation steps): no spread for a t-test
        lo = hi = NAN
        moved = [x for x in d if x != 0]
        p = float(stats.binomtest(sum(x > 0 for x in moved), len(moved)).pvalue) if moved else 1.0
    else:
        half = stats.t.ppf(0.975, n - 1) * sd / math.sqrt(n)
        lo, hi = m - half, m + half
        p = float(stats.ttest_rel(d, [0.0] * n).pvalue)  # the effects against no effect, pair by pair
    if claimed is None:
        verdict = ""
    elif (lo >= claimed if finite(lo) else m >= claimed) and p < 0.05:  # the interval clears the size, not only 0
        verdict = "holds"
    elif hi < claimed or (m < 0 and p < 0.05):
        verdict = "fails"
    else:
        verdict = "inconclusive"
    return Judged(n, m, lo, hi, p, verdict)


def reduction(base: float, treat: float) -> float:
    return 1 - treat / base if base else NAN


def gain(base: float, treat: float) -> float:
    return treat / base - 1 if base else NAN


def diff(base: float, treat: float) -> float:
    return treat - base


def speedup(base: float, treat: float) -> float:
    return base / treat - 1 if treat else NAN


def compare(s: dict, claim: int, what: str, base: str, treat: str, key: str, effect, claimed, percent) -> Comparison:
    """Arm `treat` against arm `base` on one figure, seed by seed."""
    seeds = sorted(s.get(base, {}).keys() & s.get(treat, {}).keys())
    pairs = [(s[base][k][key], s[treat][k][key]) for k in seeds if finite(s[base][k][key], s[treat][k][key])]
    return Comparison(
        claim,
        what,
        base,
        treat,
        mean(b for b, _ in pairs),
        mean(t for _, t in pairs),
        [effect(b, t) for b, t in pairs],
        len(seeds),
        claimed,
        percent,
    )


# Arm against arm, seed by seed: (claim, the per-seed effect in words, base arm, the claim's arm, figure, effect,
# claimed size, relative?)
PAIRED = [
    (1, "reward variance (batch reward std², mean over steps), lower", "grpo", DESIGN, "reward_var", reduction,
     0.15, True),
    (2, "final held-out accuracy, relative gain", "grpo", DESIGN, "accuracy", gain, 0.05, True),
    (2, "final held-out accuracy, gain in points", "grpo", DESIGN, "accuracy", diff, 0.05, False),
    (3, "reward std (mean over steps), lower", "grpo", "grpo_adaptive_kl", "reward_std", reduction,
     1 - 0.18 / 0.25, True),
    (4, "steps until the held-out accuracy reaches the target and stays, speed-up (grpo's ÷ the recipe's, − 1)",
     "grpo", DESIGN, "steps_to_target", speedup, 0.2, True),
    (4, "area under the held-out accuracy curve (mean accuracy over the run), gain in points", "grpo", DESIGN, "auc",
     diff, None, False),
]  # fmt: skip


def comparisons(s: dict, stopped: dict | None = None) -> list[Comparison]:
    """The claims' comparisons from {arm: {seed: summary}}; each claim's first is the one its verdict takes.
    `stopped` ({arm: {seed: summary}} of the runs that stopped early) adds claim 1's reading on the steps the
    recipe's stopped runs made: its ratio is within each run (the same batches), so a partial run still has it."""
    partial = against_rloo(
        "the same, on the steps each stopped run of the recipe made before it stopped", (stopped or {}).get(DESIGN, {})
    )
    return [
        against_rloo(
            "advantage variance, lower than RLOO's on the same batches and rewards (mean over steps of the ratio)",
            s.get(DESIGN, {}),
        ),
        *(compare(s, *spec) for spec in PAIRED),
        *([partial] if partial.effects else []),
    ]


def against_rloo(what: str, recipe: dict) -> Comparison:
    """Claim 1 within each of the recipe's runs ({seed: summary}): its advantage variance against RLOO's on the same
    batches and rewards."""
    own = [x for x in recipe.values() if finite(x["adv_var_ratio"])]
    return Comparison(
        1,
        what,
        "RLOO, same batches",
        DESIGN,
        mean(x["adv_var_rloo"] for x in own),
        mean(x["adv_var"] for x in own),
        [1 - x["adv_var_ratio"] for x in own],
        len(recipe),
        0.15,
        True,
    )


def claim_verdicts(runs: dict, target: float) -> dict[int, str]:
    """{claim: verdict} for the runs of load_runs()."""
    comps = comparisons(summaries(runs, target))
    return {c: next(judge(x.effects, x.claimed).verdict for x in comps if x.claim == c) for c in CLAIMS}


def summaries(runs: dict, target: float, stopped: bool = False) -> dict[str, dict[int, dict]]:
    """Every finished run's summary; runs that stopped with an error are left out (`stopped`: only those)."""
    return {
        arm: {k: summarise(r, target) for k, r in seeds.items() if ("error" in r) == stopped}
        for arm, seeds in runs.items()
    }
