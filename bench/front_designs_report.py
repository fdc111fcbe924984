"""Rebuild bench/README.md's table of the HTTP front's designs from docs/data/front_designs.json alone.

    .venv/bin/python bench/concurrency.py --ks 16 64 --max-new-tokens 64 256 --rounds 3 --chat --sessions 32 \
        --fronts serve haproxy serve+coalesce2 haproxy+coalesce2 serve+fused haproxy+fused --out front_designs
    .venv/bin/python bench/front_designs_report.py

(the '+coalesce2' fronts, FARM_COALESCE_MS, ran at commit 2e25d28, which has them; they were removed after.)

It starts no service: it replaces what lies between the `<!-- front_designs:begin -->` and
`<!-- front_designs:end -->` lines of bench/README.md. Per design and case: the median over rounds of K concurrent
one-sample requests' samples/s over one K-sample request's (bench/concurrency.py), and the CPU every process of the
service spends per one-sample request beyond the K-sample request's per sample. Each design is compared with the
baseline (the split front behind Serve's proxy) case by case: a one-sided Welch t-test on the rounds' log ratios
(each design ran in a pass of its own, so rounds pair with nothing), and a verdict per design on the goal (>= 0.8 in
every case of the issue: rollouts at 64 and 256 tokens, chat, sessions, at K = 16 and 64).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from scipy import stats

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "docs" / "data" / "front_designs.json"
README = ROOT / "bench" / "README.md"
BEGIN, END = "<!-- front_designs:begin -->", "<!-- front_designs:end -->"
BASELINE = "serve"
GOAL = 0.8
ALPHA = 0.05
NAMES = {
    "serve": "split front, Serve's proxy (the default before issue 38)",
    "haproxy": "split front, HAProxy",
    "serve+coalesce2": "split, Serve's proxy, coalescing 2 ms (b)",
    "haproxy+coalesce2": "split, HAProxy, coalescing 2 ms (b)",
    "serve+fused": "fused, Serve's proxy (a without HAProxy)",
    "haproxy+fused": "fused, HAProxy straight to the replica (a)",
}


def cases(results: dict, front: str) -> list[str]:
    return sorted(k.split(":", 1)[1] for k in results if k.startswith(f"{front}:"))


def ratios(results: dict, front: str, case: str) -> list[float]:
    return results[f"{front}:{case}"]["per_round"]["ratio"]


def cell(results: dict, front: str, case: str) -> str:
    s = results[f"{front}:{case}"]
    lo, hi = s["range"]
    mark = "" if s["median_ratio"] >= GOAL else "*"
    return f"{s['median_ratio']:.2f}{mark} ({lo:.2f}-{hi:.2f})"


def faster_than_baseline(results: dict, front: str, case: str) -> float:
    """One-sided Welch p that the design's log ratios are above the baseline's (NaN without spread)."""
    a = [math.log(r) for r in ratios(results, front, case)]
    b = [math.log(r) for r in ratios(results, BASELINE, case)]
    if len(a) < 2 or len(b) < 2:
        return float("nan")
    return float(stats.ttest_ind(a, b, equal_var=False, alternative="greater").pvalue)


def render(data: dict) -> str:
    results, fronts = data["results"], data["args"]["fronts"]
    shown = [c for c in cases(results, fronts[0]) if not c.startswith("engine")]
    head = ["design"] + [c.replace("_", " ") for c in shown] + ["extra CPU ms per one-sample rollout (64 tok, K=64)"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for front in fronts:
        extra = results[f"{front}:rollouts_64tok_k64"].get("median_extra_cpu_ms_per_request", float("nan"))
        row = [NAMES.get(front, front)] + [cell(results, front, c) for c in shown] + [f"{extra:.1f}"]
        lines.append("| " + " | ".join(row) + " |")
    engine = [c for c in results if c.startswith("engine")]
    lines += [
        "",
        "In process (the engine alone, no service): "
        + ", ".join(f"{c.split('_', 1)[1].replace('_', ' ')} {results[c]['median_ratio']:.2f}" for c in sorted(engine))
        + "."
        if engine
        else "",
    ]
    lines += ["", f"Medians over {data['args']['rounds']} rounds (range); * below the goal {GOAL}. Verdicts:", ""]
    for front in fronts:
        met = [c for c in shown if results[f"{front}:{c}"]["median_ratio"] >= GOAL]
        line = f"- {NAMES.get(front, front)}: meets {GOAL} in {len(met)} of {len(shown)} cases"
        if front != BASELINE:
            better = [c for c in shown if faster_than_baseline(results, front, c) < ALPHA]
            line += f"; above the baseline (Welch one-sided p < {ALPHA}) in {len(better)}"
            line += f" ({', '.join(better)})" if better else ""
        lines.append(line + ".")
    return "\n".join(lines) + "\n"


def main() -> None:
    sys.path.insert(0, str(ROOT))
    from bench.common import write_section

    write_section(README, BEGIN, END, render(json.loads(DATA.read_text())))
    print(f"wrote the table into {README.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
