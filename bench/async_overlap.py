"""Async training: the same training run three ways, synchronous, async with staleness 1 and async with staleness 2
(async_training.staleness_threshold), side by side in one process against one service.

Part a, the bench engine. No model generates: each decode step of a generate call sleeps a fixed latency
(OverlapBenchEngine below: the bench engine, with the weight spec of the model folder so that the trainer's pushes
pass the service's checks, and its latency read from a file at each call, so that one service serves every
setting). Generation takes a known time and no CPU; the trainer trains arith-tiny on the random tokens (rewards from
a hash of the text, so advantages are not all 0). A synchronous calibration run measures t_T (the step minus the
wait for rollouts: training, the push, the bookkeeping; its median step) and how t_R (the wait) grows with the
latency; then for each target t_R/t_T in --ratios the latency is set, and --rounds rounds of the three runs follow.
Ideal speed-up: (t_R + t_T) / max(t_R, t_T) from the sync runs' median t_R and t_T at that latency. Async's
speed-up: the median sync step time / async's. Goal: >= 90% of the ideal. Step time: the wall time between the ends
of step --warmup and of the last step, per step.

Part b, the real model on CPU (arith-tiny through the torch engine, the demo's task, the trainer's default learning
rate 5e-5, at which the rewarded format is learnt between steps 10 and 20: bench/claims.py's grpo arm): sync and
async (staleness 1) over --seeds, the same prompts in the same order (the same seed draws the same batches), the
same number of samples; then greedy held-out accuracy on --eval-size problems (the task has 416). Speed-up and
accuracy are paired by seed: a paired t-test over the seeds (scipy's ttest_rel) and a 95% t interval of the mean
difference, with the verdicts of RULES.

The trainer gets one torch thread (the engine has the other core: FARM_ENGINE_THREADS=1 in part b), so that the
two overlap and a busy machine slows it in proportion rather than by thread contention. Before each run the
script waits (up to --max-quiet-wait-s) for other processes to use under --quiet of the cores; a part-a run during
which they used more than --max-foreign is measured again (at most --retries times); each run records the share.

Results: docs/data/async_overlap.json and the tables printed. Commands:
    .venv/bin/python bench/async_overlap.py            # both parts (about 25 min on 2 idle cores)
    .venv/bin/python bench/async_overlap.py --part a   # or b
"""

from __future__ import annotations

import os
import sys
import zlib
from pathlib import Path

from rollout_farm.services.engine.bench_engine import BenchEngine
from rollout_farm.services.extensions.rewards import REWARDS

LATENCY_FILE = "bench_latency_s"  # in the service's FARM_STATE_DIR


@REWARDS.register("overlap_bench")
def text_hash_reward(text: str, ground_truth: str | None) -> float:
    """0 or 1 by a hash of the text: random tokens get rewards that vary within a group."""
    return float(zlib.crc32(text.encode()) % 2)


class OverlapBenchEngine(BenchEngine):
    """The bench engine with the weight spec of the model folder (the names, shapes and dtypes of its
    model.safetensors: what the trainer pushes), and its token latency read from <state_dir>/bench_latency_s at
    each generate call (the settings' bench_token_latency_s while there is no such file)."""

    needs_model = True

    def __init__(self, model_path: str, token_latency_s: float, latency_file: Path | None):
        from rollout_farm.services.weights.checks import read_header_file

        super().__init__(model_path, token_latency_s)
        self.spec = read_header_file(Path(model_path) / "model.safetensors")
        self.latency_file = latency_file

    @classmethod
    def from_settings(cls, model_path, settings, threads) -> OverlapBenchEngine:
        folder = Path(settings.state_dir) if settings.state_dir else None
        return cls(model_path, settings.bench_token_latency_s, folder / LATENCY_FILE if folder else None)

    def generate(self, prompts, params, cancel=None):
        if self.latency_file is not None and self.latency_file.exists():
            self.token_latency_s = float(self.latency_file.read_text())
        return super().generate(prompts, params, cancel)

    def weight_spec(self):
        return self.spec


# the benchmark itself: only when run as a script (the service's processes import this module for the engine) ------

RULES = {
    "speedup": "async / sync steps per second, per seed; holds if the mean is above 1 with p < 0.05 (t-test of the "
    "per-seed speed-ups against 1), fails if the whole 95% interval of the speed-up is at or below 1, else "
    "inconclusive",
    "accuracy": "async minus sync held-out accuracy, per seed; fails if async is lower with p < 0.05; holds if the "
    "whole 95% interval of the difference lies within +-0.03 (no difference that size); else inconclusive",
}
MARGIN = 0.03


def trainer_config(url: str, model: Path, name: str, out: Path, *overrides: str):
    from rollout_farm.trainer.config import load

    return load(
        None,
        [
            f"trainer.service_url={url}",
            f"actor_rollout_ref.model.path={model}",
            "trainer.task=arith",
            "trainer.rollout_source=queue",
            f"trainer.queue_source={name}",
            f"trainer.default_local_dir={out}",
            "trainer.resume_mode=disable",
            "trainer.eval_size=0",
            *overrides,
        ],
    )


def train_once(url: str, model: Path, name: str, staleness: int, *overrides: str) -> tuple[dict, object]:
    """One training run in this process against the service, its queue source removed after; (its summary, the
    TrainingRun)."""
    import json
    import tempfile

    from common import TOKEN, CpuMeter

    from rollout_farm.trainer.loop import train
    from rollout_farm.trainer.run import TrainingRun

    out = Path(tempfile.mkdtemp(prefix=f"async-overlap-{name}-"))
    cfg = trainer_config(url, model, name, out, f"async_training.staleness_threshold={staleness}", *overrides)
    run = TrainingRun(cfg, TOKEN)
    try:
        with CpuMeter() as cpu:
            train(run)
    finally:
        run.client.queue_remove_source(name)
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return summarise(steps) | {"other_processes_cpu_share": cpu.foreign}, run


def summarise(steps: list[dict], warmup: int | None = None) -> dict:
    """Per-step figures after the warm-up: step time (between the ends of step `warmup` and the last), the wait
    for rollouts (t_R) and the rest (t_T), the idle ratios; over every step: staleness, drops, corrections."""
    import statistics

    w = WARMUP if warmup is None else warmup
    timed = steps[w:]
    cycle = (steps[-1]["elapsed_s"] - steps[w - 1]["elapsed_s"]) / len(timed)
    wait = statistics.fmean(s["rollout_wait_s"] for s in timed)
    rest = [b["elapsed_s"] - a["elapsed_s"] - b["rollout_wait_s"] for a, b in zip(steps[w - 1 :], timed)]
    hist: list[int] = []
    for s in steps:
        for lag, count in enumerate(s.get("staleness_hist", [])):
            hist += [0] * (lag + 1 - len(hist))
            hist[lag] += count
    rollout_idle = [s["rollout_idle_ratio"] for s in timed if s.get("rollout_idle_ratio") is not None]
    weights = [s["offpolicy_is_weight_mean"] for s in steps if s.get("offpolicy_is_weight_mean") is not None]
    return {
        "steps": len(steps),
        "step_s": cycle,
        "t_R": wait,
        "t_T": cycle - wait,
        "t_T_median": statistics.median(rest),
        "push_s": statistics.fmean(s["push_seconds"] for s in timed),
        "trainer_idle_ratio": statistics.fmean(s["trainer_idle_ratio"] for s in timed),
        "rollout_idle_ratio": statistics.fmean(rollout_idle) if rollout_idle else None,
        "staleness_hist": hist,
        "staleness_max": max(s["staleness_max"] for s in steps),
        "spanning_samples": sum(s.get("spanning_samples", 0) for s in steps),
        "stale_dropped_groups": sum(s.get("stale_dropped_groups", 0) for s in steps),
        "refused_groups": sum(s.get("refused_groups", 0) for s in steps),
        "offpolicy_fraction": statistics.fmean(s["offpolicy_fraction"] for s in steps),
        "offpolicy_is_weight_mean": statistics.fmean(weights) if weights else None,
        "offpolicy_clipped_fraction": statistics.fmean(s.get("offpolicy_clipped_fraction", 0.0) for s in steps),
        "offpolicy_masked_fraction": statistics.fmean(s.get("offpolicy_masked_fraction", 0.0) for s in steps),
        "reward_mean_last": steps[-1]["reward_mean"],
    }


WARMUP = 2
MODES = {"sync": 0, "async1": 1, "async2": 2}


def serve(**settings) -> str:
    """common.start_service, then SIGTERM ends this script through its finally blocks (which stop the service):
    after ray.init, whose own handler would abort the process and leave Ray's processes behind."""
    import signal

    from common import start_service

    url = start_service(**settings)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    return url


def measured(args, url: str, model: Path, name: str, staleness: int, *overrides: str) -> dict:
    """train_once after wait_quiet, again (up to --retries times) while other processes used more than
    --max-foreign of the cores during it; the last try's summary, with the number of tries."""
    from common import log, wait_quiet

    for attempt in range(1, args.retries + 2):
        wait_quiet(args.quiet, args.max_quiet_wait_s)
        got, _ = train_once(url, model, f"{name}-{attempt}", staleness, *overrides)
        if got["other_processes_cpu_share"] <= args.max_foreign:
            break
        log(f"{name}: other processes used {got['other_processes_cpu_share']:.0%} of the cores: measuring again")
    return got | {"tries": attempt}


def part_a(args, model: Path) -> dict:
    """The bench engine: calibrate; then at each target ratio, --rounds rounds of sync, async1, async2 (the median
    step time of each mode over the rounds; the ideal from the sync runs' median t_R and t_T)."""
    import math
    import statistics
    import tempfile

    from common import log, stop_service

    state = Path(tempfile.mkdtemp(prefix="async-overlap-state-"))
    latency_file = state / LATENCY_FILE
    url = serve(
        model=str(model),
        engine="async_overlap:OverlapBenchEngine",
        plugins=["async_overlap"],
        replicas=1,
        engine_num_cpus=0,
        bench_token_latency_s=0.01,
        state_dir=str(state),
        log_level="WARNING",
    )
    B, T = args.batch_a, args.tokens_a
    common = [
        f"data.train_batch_size={B}",
        "actor_rollout_ref.rollout.n=4",
        f"data.max_response_length={T}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={B}",
        "trainer.reward=overlap_bench",
        f"trainer.total_training_steps={args.steps_a}",
    ]
    slope = math.ceil(B / 4) * T  # seconds of t_R per second of latency: the queue generates 4 groups a call
    out: dict = {"calibration": {}, "ratios": []}
    try:
        lat0 = 0.01
        latency_file.write_text(str(lat0))
        calib = measured(args, url, model, "overlap-calibrate", 0, *common)
        overhead = calib["t_R"] - slope * lat0
        t_T = calib["t_T_median"]
        out["calibration"] = {"latency_s": lat0, **calib, "t_R_overhead_s": overhead, "t_R_per_latency": slope}
        log(f"calibration: t_T {t_T:.3f}s (median), t_R {calib['t_R']:.3f}s at {lat0}s a token")
        for ratio in [float(r) for r in args.ratios.split(",")]:
            latency = max(0.0, (ratio * t_T - overhead) / slope)
            latency_file.write_text(str(latency))
            rounds: dict[str, list[dict]] = {mode: [] for mode in MODES}
            for r in range(args.rounds):
                for mode, s in MODES.items():
                    got = measured(args, url, model, f"overlap-{mode}-{ratio}-{r}", s, *common)
                    rounds[mode].append(got)
                    log(f"ratio {ratio} round {r + 1} {mode}: step {got['step_s']:.3f}s, wait {got['t_R']:.3f}s")
            med = {
                m: {k: statistics.median(x[k] for x in runs) for k in ("step_s", "t_R", "t_T")}
                for m, runs in rounds.items()
            }
            t_R, t_T_here = med["sync"]["t_R"], med["sync"]["t_T"]
            ideal = (t_R + t_T_here) / max(t_R, t_T_here)
            row = {"target_ratio": ratio, "latency_s": latency, "t_R": t_R, "t_T": t_T_here, "ratio": t_R / t_T_here}
            row |= {"ideal_speedup": ideal, "median": med, "rounds": rounds}
            for mode in ("async1", "async2"):
                speedup = med["sync"]["step_s"] / med[mode]["step_s"]
                row[f"{mode}_speedup"] = speedup
                row[f"{mode}_of_ideal"] = speedup / ideal
            out["ratios"].append(row)
    finally:
        stop_service()
    out["goal"] = "async step rate / sync >= 90% of (t_R + t_T) / max(t_R, t_T)"
    out["met"] = all(r[f"{m}_of_ideal"] >= 0.9 for r in out["ratios"] for m in ("async1", "async2"))
    return out


def part_b(args, model: Path) -> dict:
    """The real model on CPU: sync and async (staleness 1) per seed; speed-up and held-out accuracy, paired."""
    import torch
    from common import log, start_service, stop_service

    from rollout_farm.trainer.evaluate import evaluate
    from rollout_farm.trainer.sync.rollouts import render_prompt

    torch.set_num_threads(1)
    url = start_service(model=str(model), replicas=1, engine_threads=1, log_level="WARNING")
    B = args.batch_b
    common = [
        f"data.train_batch_size={B}",
        "actor_rollout_ref.rollout.n=8",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={B}",
        f"trainer.total_training_steps={args.steps_b}",
    ]
    seeds = [int(s) for s in args.seeds.split(",")]
    rows = []
    try:
        for seed in seeds:
            row: dict = {"seed": seed}
            for mode, s in (("sync", 0), ("async1", 1)):
                summary, run = train_once(url, model, f"overlap-b-{mode}-{seed}", s, *common, f"trainer.seed={seed}")
                scored = evaluate(run.client, run.task, lambda p, tok=run.tok: render_prompt(tok, p), args.eval_size)
                row[mode] = summary | {"accuracy": scored.value, "samples": args.steps_b * B * 8}
                log(f"seed {seed} {mode}: step {summary['step_s']:.2f}s, accuracy {scored.value:.3f}")
            row["speedup"] = row["sync"]["step_s"] / row["async1"]["step_s"]
            t_R, t_T = row["sync"]["t_R"], row["sync"]["t_T"]
            row["ideal_speedup"] = (t_R + t_T) / max(t_R, t_T)
            row["accuracy_diff"] = row["async1"]["accuracy"] - row["sync"]["accuracy"]
            rows.append(row)
    finally:
        stop_service()
    return {"seeds": rows, **paired_verdicts(rows)}


def paired_verdicts(rows: list[dict]) -> dict:
    """The paired t-tests over the seeds and the verdicts of RULES."""
    import math
    import statistics

    from scipy import stats

    def interval(d: list[float]) -> tuple[float, float, float, float]:
        m = statistics.fmean(d)
        if len(d) < 2 or statistics.stdev(d) == 0:
            return m, m, m, 1.0 if m == 0 else 0.0
        half = float(stats.t.ppf(0.975, len(d) - 1)) * statistics.stdev(d) / math.sqrt(len(d))
        return m, m - half, m + half, float(stats.ttest_rel(d, [0.0] * len(d)).pvalue)

    m, lo, hi, p = interval([r["speedup"] - 1 for r in rows])
    m, lo, hi = m + 1, lo + 1, hi + 1
    if m > 1 and p < 0.05:
        speed = "holds"
    elif hi <= 1:
        speed = "fails"
    else:
        speed = "inconclusive"
    am, alo, ahi, ap = interval([r["accuracy_diff"] for r in rows])
    if am < 0 and ap < 0.05:
        acc = "fails"
    elif -MARGIN <= alo and ahi <= MARGIN:
        acc = "holds"
    else:
        acc = "inconclusive"
    return {
        "speedup": {"mean": m, "ci95": [lo, hi], "p": p, "verdict": speed, "rule": RULES["speedup"]},
        "accuracy_diff": {"mean": am, "ci95": [alo, ahi], "p": ap, "verdict": acc, "rule": RULES["accuracy"]},
    }


def report_a(a: dict) -> None:
    import statistics

    from common import table

    rows = []
    for r in a["ratios"]:
        for mode in MODES:
            med, runs = r["median"][mode], r["rounds"][mode]
            speed = r["median"]["sync"]["step_s"] / med["step_s"]
            idle = [x["rollout_idle_ratio"] for x in runs if x["rollout_idle_ratio"] is not None]
            hist = [sum(x["staleness_hist"][i] for x in runs if i < len(x["staleness_hist"])) for i in range(3)]
            rows.append(
                [
                    r["ratio"],
                    mode,
                    med["step_s"],
                    med["t_R"],
                    med["t_T"],
                    speed,
                    r["ideal_speedup"],
                    speed / r["ideal_speedup"],
                    statistics.fmean(x["trainer_idle_ratio"] for x in runs),
                    statistics.fmean(idle) if idle else "-",
                    str(hist),
                    sum(x["stale_dropped_groups"] for x in runs),
                    max(x["other_processes_cpu_share"] for x in runs),
                ]
            )
    heads = ["t_R/t_T", "mode", "step s", "wait s", "rest s", "speed-up", "ideal", "of ideal", "trainer idle"]
    print("part a: the bench engine (generation sleeps; the trainer trains arith-tiny on its tokens); medians")
    print(table(heads + ["rollout idle", "staleness hist", "dropped", "others' CPU"], rows))
    print(f"goal: async >= 90% of the ideal speed-up: {'met' if a['met'] else 'NOT met'}")


def report_b(b: dict) -> None:
    import statistics

    from common import table

    rows = []
    for r in b["seeds"]:
        for mode in ("sync", "async1"):
            run = r[mode]
            rows.append(
                [
                    r["seed"],
                    mode,
                    run["step_s"],
                    run["t_R"],
                    run["trainer_idle_ratio"],
                    run["rollout_idle_ratio"] if run["rollout_idle_ratio"] is not None else "-",
                    str(run["staleness_hist"]),
                    run["spanning_samples"],
                    run["accuracy"],
                ]
            )
    print("part b: arith-tiny on CPU (torch engine), the same prompts and samples per seed")
    heads = ["seed", "mode", "step s", "wait s", "trainer idle", "rollout idle", "staleness hist", "spanning"]
    print(table(heads + ["accuracy"], rows))
    s, a = b["speedup"], b["accuracy_diff"]
    ideal = statistics.fmean(r["ideal_speedup"] for r in b["seeds"])
    print(
        f"speed-up async/sync: {s['mean']:.3f} (95% CI {s['ci95'][0]:.3f}-{s['ci95'][1]:.3f}, p {s['p']:.3f}) -> "
        f"{s['verdict']}; the sync runs' (t_R + t_T) / max(t_R, t_T): {ideal:.3f}"
    )
    print(
        f"accuracy async - sync: {a['mean']:+.3f} (95% CI {a['ci95'][0]:+.3f} to {a['ci95'][1]:+.3f}, "
        f"p {a['p']:.2f}) -> {a['verdict']}"
    )


def run_parts(args) -> None:
    import torch
    from common import resolve, write_json

    torch.set_num_threads(1)  # the trainer: one core (the engine has the other); no spinning threads under load
    global WARMUP
    WARMUP = args.warmup
    model = resolve("arith-tiny")
    result: dict = {"args": vars(args)}
    if "a" in args.part:
        result["a"] = part_a(args, model)
        report_a(result["a"])
    if "b" in args.part:
        result["b"] = part_b(args, model)
        report_b(result["b"])
    write_json("async_overlap", result)


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=["a", "b", "ab"], default="ab")
    ap.add_argument("--ratios", default="0.5,1,2", help="part a: target t_R / t_T")
    ap.add_argument("--steps-a", type=int, default=10, help="part a: steps per run")
    ap.add_argument("--warmup", type=int, default=2, help="steps left out of the step time (async fills its queue)")
    ap.add_argument("--rounds", type=int, default=2, help="part a: rounds of the three runs at each ratio")
    ap.add_argument("--quiet", type=float, default=0.3, help="before each run, wait until others use less CPU")
    ap.add_argument("--max-quiet-wait-s", type=float, default=120.0, help="... but at most this long")
    ap.add_argument("--max-foreign", type=float, default=0.4, help="measure a run again above this CPU share...")
    ap.add_argument("--retries", type=int, default=2, help="... at most this many times")
    ap.add_argument("--batch-a", type=int, default=4, help="part a: prompts per step")
    ap.add_argument("--tokens-a", type=int, default=32, help="part a: tokens per sample")
    ap.add_argument("--seeds", default="0,1,2", help="part b")
    ap.add_argument("--steps-b", type=int, default=20, help="part b: steps per run")
    ap.add_argument("--batch-b", type=int, default=32, help="part b: prompts per step (8 samples each)")
    ap.add_argument("--eval-size", type=int, default=1000, help="part b: held-out problems scored after each run")
    args = ap.parse_args()
    bench = Path(__file__).resolve().parent
    sys.modules.setdefault("async_overlap", sys.modules["__main__"])  # the plugin is this module: register once
    os.environ["PYTHONPATH"] = os.pathsep.join([str(bench), str(bench.parent), os.environ.get("PYTHONPATH", "")])
    run_parts(args)


if __name__ == "__main__":
    main()
