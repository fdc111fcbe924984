"""Rebuild docs/results.md's claims section and docs/img/claims_*.png from bench/claims.py's data files alone.

    .venv/bin/pip install -c requirements.lock -e '.[bench]'   # matplotlib and scipy
    .venv/bin/python bench/claims_report.py

It reads docs/data/claims/*.json (one file per arm and seed), starts no service and trains nothing, and
replaces what lies between the `<!-- claims:begin -->` and `<!-- claims:end -->` lines of docs/results.md.
The same files give the same markdown, byte for byte. Comparisons pair runs by seed (run k of every arm has
the same prompts and sampling seeds); each gets a paired t-test and a verdict by RULE.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.claims_stats import (  # noqa: E402
    ARM_ORDER,
    CLAIMS,
    POLICY_FIGURES,
    RULE,
    Comparison,
    comparisons,
    finite,
    judge,
    kept,
    load_runs,
    summaries,
)

DATA = ROOT / "docs" / "data" / "claims"
MARKDOWN = ROOT / "docs" / "results.md"
IMG = ROOT / "docs" / "img"
BEGIN, END = "<!-- claims:begin -->", "<!-- claims:end -->"
PLOTS = {
    "val_accuracy": "held-out accuracy",
    "reward_mean": "reward (mean over the batch)",
    "kl_ref": "KL to the reference",
    "adv_var": "advantage variance",
}


def spread(xs: list[float], digits: str = ".3f") -> str:
    xs = [x for x in xs if finite(x)]
    if not xs:
        return "n/a"
    if len(xs) == 1:
        return format(xs[0], digits)
    return f"{format(statistics.fmean(xs), digits)} ± {format(statistics.stdev(xs), digits)}"


def effect_text(x: float, percent: bool) -> str:
    if not finite(x):
        return "n/a"
    return f"{x * 100:+.1f}%" if percent else f"{x:+.3f}"


def p_text(p: float) -> str:
    return "n/a" if not finite(p) else "< 0.001" if p < 0.001 else f"{p:.3f}"


def shown(path: Path) -> str:
    """A path as the commands show it: relative to the repository when inside it."""
    path = Path(path).resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def provenance(runs: dict, data_dir: Path, rebuild_cmd: str) -> list[str]:
    """Which command made the data, which rebuilds this section, and from what commit, when and where."""
    records = [r for seeds in runs.values() for r in seeds.values()]
    settings = sorted({json.dumps(r["settings"], sort_keys=True) for r in records})
    seeds = max(r["seed"] for r in records) + 1
    cmds = []
    for text in settings:
        st = json.loads(text)
        cmd = f".venv/bin/python bench/claims.py --steps {st['steps']} --seeds {seeds} --test-freq {st['test_freq']}"
        cmd += f" --eval-size {st['eval_size']}" if st["eval_size"] != 1000 else ""
        cmd += f" --arms {' '.join(runs)}" if list(runs) != list(ARM_ORDER) else ""
        cmd += f" --data-dir {shown(data_dir)}" if Path(data_dir).resolve() != DATA else ""
        cmds.append(f"`{cmd}`")
    machines = sorted(
        {
            f"{m['cpus']} CPUs, {m['cuda'] or 'no GPU'}, torch {m['torch']}, Python {m['python']}"
            for m in (r["machine"] for r in records)
        }
    )
    dates = sorted(r["date"][:10] for r in records)
    hours = sum(r["wall_s"] for r in records) / 3600
    return [
        f"Data: {len(records)} runs ({len(runs)} arms × up to {seeds} seeds) in `{shown(data_dir)}/`, one JSON file "
        f"per arm and seed, written by {' and '.join(cmds)}"
        + (" (mixed settings)" if len(settings) > 1 else "")
        + f"; {hours:.1f} h of training in all. Rebuild this section and its plots from them: "
        f"`{rebuild_cmd}`.",
        f"Commit {', '.join(sorted({r['commit'][:12] for r in records}))}; run {dates[0]}"
        + (f" to {dates[-1]}" if dates[-1] != dates[0] else "")
        + f"; {'; '.join(machines)}.",
    ]


def setup_lines(runs: dict) -> list[str]:
    """The arms' overrides: those every arm shares once, then each arm's own."""
    lists = {arm: next(iter(seeds.values()))["overrides"] for arm, seeds in runs.items()}
    shared = [o for o in next(iter(lists.values())) if all(o in x for x in lists.values())]
    st = next(iter(next(iter(runs.values())).values()))["settings"]
    out = [
        f"Every run trains {st['steps']} steps; run k of every arm has `trainer.seed=k`, so paired runs get the same "
        "prompts in the same order and the same sampling seeds. "
        + (f"Every {st['test_freq']} steps" if st["test_freq"] > 1 else "Every step")
        + f" the trainer scores the held-out split greedily (`trainer.eval_size={st['eval_size']}`"
        "; the arith split has 416 problems); 'final' is the last step's score. Every arm: "
        + ", ".join(f"`{o}`" for o in shared)
        + ". Then:",
        "",
    ]
    for arm, overrides in lists.items():
        own = [f"`{o}`" for o in overrides if o not in shared]
        out.append(f"- `{arm}`: {', '.join(own) or 'nothing else'}")
    return out


def arm_table(s: dict, runs: dict, target: float) -> list[str]:
    head = (
        "| arm | seeds | final held-out accuracy | any-format accuracy | reward std | KL to reference | "
        f"advantage variance | k tokens generated | steps to {target:.2f} and after | KL coefficient β over the "
        "runs (min–max) | guard actions |"
    )
    out = [head, "|" + " --- |" * 11]
    for arm, seeds in s.items():
        xs = list(seeds.values())
        reached = [x["steps_to_target"] for x in xs if finite(x["steps_to_target"])]
        reach = f"{spread(reached, '.1f')} ({len(reached)}/{len(xs)} reached)" if reached else f"never (0/{len(xs)})"
        rollbacks, raises = sum(x["rollbacks"] for x in xs), sum(x["raises"] for x in xs)
        guard = ", ".join(f"{n} {what}" for n, what in ((rollbacks, "rollbacks"), (raises, "raises")) if n) or "none"
        cells = [spread([x[k] for x in xs]) for k in ("accuracy", "number_accuracy", "reward_std", "kl", "adv_var")]
        cells.append(spread([x["ktokens"] for x in xs], ".1f"))
        betas = [b for x in xs for b in x["beta"]]
        beta = f"{min(betas):.2g}–{max(betas):.2g}" if betas else "n/a"
        out.append(f"| `{arm}` | {len(xs)} | {' | '.join(cells)} | {reach} | {beta} | {guard} |")
    out += ["", "mean ± std over seeds. Final held-out accuracy per seed:", ""]
    for arm, seeds in s.items():
        out.append(f"- `{arm}`: " + (" / ".join(f"{x['accuracy']:.3f}" for x in seeds.values()) or "no run finished"))
    stopped = [(arm, k, r["error"]) for arm, seeds in runs.items() for k, r in seeds.items() if "error" in r]
    if stopped:
        out += ["", "Stopped early, left out of every figure here:", ""]
        out += [f"- `{arm}` seed {k}: {error}" for arm, k, error in stopped]
    return out


def comparison_table(comps: list[Comparison]) -> list[str]:
    out = [
        "| claim | per-seed effect (claimed direction positive) | seeds | measured against | value | "
        "claim's side | value | effect: mean [95% CI] | p | claimed | verdict |",
        "|" + " --- |" * 11,
    ]
    for c in comps:
        j = judge(c.effects, c.claimed)
        ci = f" [{effect_text(j.lo, c.percent)}, {effect_text(j.hi, c.percent)}]" if finite(j.lo) else ""
        seeds = f"{j.n}" if j.n == c.paired else f"{j.n} of {c.paired}"
        claimed = "—" if c.claimed is None else effect_text(c.claimed, c.percent)
        out.append(
            f"| {c.claim} | {c.what} | {seeds} | {c.base} | {value_text(c.base_value)} | `{c.treat}` | "
            f"{value_text(c.treat_value)} | {effect_text(j.mean, c.percent)}{ci} | {p_text(j.p)} | {claimed} | "
            f"{j.verdict or '(reported)'} |"
        )
    return out


def value_text(x: float) -> str:
    return f"{x:.4g}" if finite(x) else "n/a"


def verdict_table(comps: list[Comparison]) -> list[str]:
    out = ["| # | claim | verdict | on |", "| --- | --- | --- | --- |"]
    for claim, text in CLAIMS.items():
        c = next(x for x in comps if x.claim == claim)
        out.append(f"| {claim} | {text} | **{judge(c.effects, c.claimed).verdict}** | {c.what} |")
    return out


def notes(seeds: int) -> list[str]:
    """How to read the figures: what holds whatever the data."""
    from scipy import stats

    t = stats.t.ppf(0.975, max(1, seeds - 1))
    return [
        "Reading the figures:",
        "",
        "- GRPO scales advantages by each group's reward std and REINFORCE++ whitens them over the batch, so their "
        "advantage variance reflects that scaling (and the share of all-equal groups, whose GRPO advantages are 0), "
        "not reward units. RLOO's and control_variate's are in reward units: claim 1's first comparison sets the "
        "recipe's advantages against RLOO's computed on the same batch and rewards.",
        "- With 0/1 rewards a batch's reward std is √(p(1−p)) of its mean reward p: it follows the reward, not "
        "the KL control. A lower std is not by itself a better signal.",
        "- One score on 416 problems has a binomial standard error of about 0.024 near 0.5."
        + (f" With {seeds} seeds the 95% interval is the mean ± {t:.2f} × std / √{seeds}." if seeds > 1 else ""),
        "- `design_recipe` changes several parts at once (sampler, estimator, epochs, mini-batch, KL control, "
        "guards): its verdicts are about the recipe as a whole, not about any one part.",
        "- Steps to target: the first evaluated step from which the held-out accuracy stays at or above the target "
        "to the end of the run (a rollback can undo a step that touched it). They move in whole evaluation steps; "
        "a seed whose run in either arm never got there drops out of that comparison (the seeds column says how "
        "many remain).",
    ]


def section(runs: dict, target: float, data_dir: Path, img_rel: str, rebuild_cmd: str) -> str:
    """The markdown between the markers."""
    s = summaries(runs, target)
    comps = comparisons(s, summaries(runs, target, stopped=True))
    lines = [
        "## The design's claims (issues 5, 13 and 29)",
        "",
        "<!-- generated by bench/claims_report.py from the data files; edits between the markers are overwritten -->",
        "",
        *provenance(runs, data_dir, rebuild_cmd),
        "",
        *setup_lines(runs),
        "",
        *arm_table(s, runs, target),
        "",
        "### Verdicts",
        "",
        *verdict_table(comps),
        "",
        RULE,
        "",
        *comparison_table(comps),
        "",
        *notes(max(len(seeds) for seeds in runs.values())),
        "",
        *(f"![{label}]({img_rel}/claims_{key}.png)" for key, label in PLOTS.items()),
    ]
    return "\n".join(lines) + "\n"


def replace_section(markdown: Path, text: str) -> None:
    """Put `text` between the markers of `markdown`."""
    doc = markdown.read_text()
    if doc.count(BEGIN) != 1 or doc.count(END) != 1 or doc.index(BEGIN) > doc.index(END):
        raise SystemExit(f"{markdown}: needs one '{BEGIN}' line and, after it, one '{END}' line around the section")
    head, rest = doc.split(BEGIN)
    tail = rest.split(END)[1]
    markdown.write_text(f"{head}{BEGIN}\n{text}{END}{tail}")


def plot(runs: dict, img_dir: Path) -> list[Path]:
    """One PNG per PLOTS key: each seed a thin line, the mean over seeds a thick one, per arm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    img_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for key, label in PLOTS.items():
        fig, ax = plt.subplots(figsize=(6.4, 3.8))
        for i, (arm, seeds) in enumerate(runs.items()):
            by_step: dict[int, list[float]] = {}
            for r in seeds.values():
                shown_steps = kept(r["steps"]) if key in POLICY_FIGURES else r["steps"]  # the discarded policy's: out
                pts = [(s["step"], s[key]) for s in shown_steps if s.get(key) is not None]
                for step, v in pts:
                    by_step.setdefault(step, []).append(v)
                if pts:
                    ax.plot(*zip(*pts), color=f"C{i}", lw=0.6, alpha=0.35)
            if by_step:
                steps = sorted(by_step)
                ax.plot(steps, [statistics.fmean(by_step[x]) for x in steps], color=f"C{i}", lw=2, label=arm)
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        paths.append(img_dir / f"claims_{key}.png")
        fig.savefig(paths[-1], dpi=100, metadata={"Software": None})
        plt.close(fig)
    return paths


def report_command(data_dir: Path, markdown: Path, img_dir: Path | None, target: float) -> str:
    """The command line that rebuilds what rebuild() builds with these arguments."""
    args = "".join(
        f" {flag} {value}"
        for flag, value, default in (
            ("--data-dir", shown(data_dir), shown(DATA)),
            ("--markdown", shown(markdown), shown(MARKDOWN)),
            ("--img-dir", shown(img_dir or IMG), shown(IMG)),
            ("--target", target, 0.3),
        )
        if value != default
    )
    return f".venv/bin/python bench/claims_report.py{args}"


def rebuild(data_dir: Path, markdown: Path, img_dir: Path | None, target: float = 0.3) -> str:
    """The section from the data files into `markdown`, and the plots into `img_dir` (None: no plots)."""
    runs = load_runs(data_dir)
    if not runs:
        raise SystemExit(f"no data files in {data_dir}: run bench/claims.py first")
    img_rel = os.path.relpath(img_dir or IMG, Path(markdown).resolve().parent)
    finished = {arm: {k: r for k, r in seeds.items() if "error" not in r} for arm, seeds in runs.items()}
    text = section(runs, target, data_dir, img_rel, report_command(data_dir, markdown, img_dir, target))
    replace_section(markdown, text)
    if img_dir is not None:
        plot(finished, img_dir)
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data-dir", type=Path, default=DATA, help="the per-run JSON files")
    ap.add_argument("--markdown", type=Path, default=MARKDOWN, help="the file whose claims section is replaced")
    ap.add_argument("--img-dir", type=Path, default=IMG, help="where the plots go")
    ap.add_argument("--target", type=float, default=0.3, help="held-out accuracy for 'steps to target'")
    a = ap.parse_args()
    try:
        import matplotlib  # noqa: F401
        import scipy  # noqa: F401
    except ImportError:
        sys.exit("the report needs matplotlib and scipy: .venv/bin/pip install -c requirements.lock -e '.[bench]'")
    rebuild(a.data_dir, a.markdown, a.img_dir, a.target)
    print(f"rebuilt the claims section of {shown(a.markdown)} and {shown(a.img_dir)}/claims_*.png")


if __name__ == "__main__":
    main()
