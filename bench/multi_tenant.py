"""Two training runs share one farm: each a tenant training its own LoRA adapter with `farm train`, at the same time.

One `farm serve` process-equivalent (the real service in this process: Ray Serve on 127.0.0.1) on arith-tiny; two
tenants, each with its own token; two `farm train` processes started together, each with
actor_rollout_ref.model.lora_rank=--rank, its own --adapter name and trainer.seed (run A: seed 0, run B: seed 1),
--steps steps of 16 prompts x 8 samples, and the held-out arith problems (--eval-size) scored greedily before and
after, on its own adapter.

Reported per run: held-out accuracy before and after with 95% Wilson intervals, and the verdict "learns" when the
after accuracy is above the before one beyond noise: McNemar's exact one-sided test on the same problems, paired
(p < 0.01; the first evaluation is the base itself, as the adapter's first version has B = 0). Then the
isolation check: every sample each run trained on carries its own adapter's digest (the trainer stops with
PolicyMismatch otherwise, and its run fails), and the farm's records show each adapter owned by its tenant with
only its own pushes.

    .venv/bin/python bench/multi_tenant.py                 # about 25 min on 2 cores
    .venv/bin/python bench/multi_tenant.py --steps 10 --eval-size 200
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from common import ROOT, TOKEN, fresh_folder, log, provenance, start_service, stop_service, table, write_json

from rollout_farm.trainer.evaluate import wilson

RUNS = {"run-a": 0, "run-b": 1}  # adapter name -> trainer.seed


def mcnemar_p(before: list[bool], after: list[bool]) -> float:
    """McNemar's exact one-sided p-value for "after is more often right than before" on the same problems."""
    from scipy import stats

    gained = sum(1 for b, a in zip(before, after) if a and not b)
    lost = sum(1 for b, a in zip(before, after) if b and not a)
    return float(stats.binomtest(gained, gained + lost, 0.5, alternative="greater").pvalue) if gained + lost else 1.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--eval-size", type=int, default=416)
    args = ap.parse_args()

    import httpx

    url = start_service(model="arith-tiny", replicas=1)
    runs = {}
    try:
        admin = {"Authorization": f"Bearer {TOKEN}"}
        tokens = {name: httpx.post(f"{url}/v1/tenants/{name}", headers=admin).json()["token"] for name in RUNS}
        started = time.monotonic()
        for name, seed in RUNS.items():
            out = fresh_folder("multi_tenant", name)
            out.mkdir(parents=True, exist_ok=True)
            cmd = [
                sys.executable,
                "-m",
                "rollout_farm.trainer.cli",
                "train",
                "--service-url",
                url,
                "--model",
                "arith-tiny",
                "--adapter",
                name,
                "--seed",
                str(seed),
                "--steps",
                str(args.steps),
                "--train-batch-size",
                "16",
                "--n",
                "8",
                "--lr",
                str(args.lr),
                "--eval-size",
                str(args.eval_size),
                "--out",
                str(out),
                "--log-file",
                str(out / "train.log"),
                f"actor_rollout_ref.model.lora_rank={args.rank}",
                f"actor_rollout_ref.model.lora_alpha={2 * args.rank}",
                "trainer.resume_mode=disable",
            ]
            env = {**os.environ, "FARM_API_TOKEN": tokens[name], "OMP_NUM_THREADS": "1"}
            runs[name] = (subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL), out)
            log(f"{name}: farm train started (tenant {name}, seed {seed})")
        codes = {name: p.wait() for name, (p, _) in runs.items()}
        wall = time.monotonic() - started
        adapters = {a["name"]: a for a in httpx.get(f"{url}/v1/adapters", headers=admin).json()["adapters"]}
    finally:
        stop_service()

    rows, results = [], {}
    for name, (_, out) in runs.items():
        summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else {}
        before, after = summary.get("before") or {}, summary.get("after") or {}
        n = int(before.get("n") or after.get("n") or 0)
        k0, k1 = sum(before.get("correct") or []), sum(after.get("correct") or [])
        p = mcnemar_p(before.get("correct") or [], after.get("correct") or [])
        said = "learns" if codes[name] == 0 and p < 0.01 else ("failed" if codes[name] else "inconclusive")
        record = adapters.get(name, {})
        own = record.get("owner") == name and all(v.get("digest") for v in record.get("versions", []))
        rows.append(
            [
                name,
                codes[name],
                f"{before.get('accuracy', float('nan')):.3f} [{wilson(k0, n)[0]:.3f}, {wilson(k0, n)[1]:.3f}]",
                f"{after.get('accuracy', float('nan')):.3f} [{wilson(k1, n)[0]:.3f}, {wilson(k1, n)[1]:.3f}]",
                f"{p:.1e}",
                said,
                len(record.get("versions", [])),
                "yes" if own else "NO",
            ]
        )
        results[name] = {
            "exit_code": codes[name],
            "held_out_n": n,
            "before": before,
            "after": after,
            "p_one_sided": p,
            "verdict": said,
            "adapter_owner": record.get("owner"),
            "adapter_versions": [v.get("version") for v in record.get("versions", [])],
            "digests_distinct": len({v.get("digest") for v in record.get("versions", [])}),
        }
    print(f"two LoRA runs on one farm, at once: {args.steps} steps each, {wall / 60:.1f} min wall")
    print(
        table(
            ["run", "exit", "held-out before [95%]", "after [95%]", "p (after > before)", "verdict", "pushes", "own"],
            rows,
        )
    )
    write_json("multi_tenant", {"args": vars(args), "wall_s": wall, "runs": results, "provenance": provenance()})


if __name__ == "__main__":
    main()
