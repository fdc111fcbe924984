"""Control-plane scaling: samples/s at 1, 4 and 16 engine replicas of the benchmark engine.

The 'bench' engine runs no model: each decode step sleeps --token-latency-s whatever the batch size
(rollout_farm/services/engine/bench_engine.py), so one request of 1 prompt x --n samples takes about
max_new_tokens x token_latency_s on its replica, and what is left is the cost of the service itself
(HTTP proxy, the one ingress replica, routing, Ray calls, decoding, JSON).
For each replica count R the app is deployed on one Ray cluster (engine replicas reserve no CPU,
so 16 fit on a small machine), then --per-replica x R concurrent clients post rollouts in a closed loop
(httpx, a fresh request_id each, as FarmClient does) for --warmup-s, then --duration-s are measured
(again, if other processes used more than --max-foreign of the cores meanwhile).
efficiency(R) = thr(R) / (R * thr(1)); goal >= 0.8 at 16. 'ideal' is R * n / (max_new_tokens * token_latency_s).
"""

from __future__ import annotations

import argparse
import asyncio
import time
import uuid

from common import CpuMeter, free_port, log, resolve, start_service, stop_service, table, wait_quiet, write_json


async def load(url: str, concurrency: int, body: dict, warmup_s: float, duration_s: float) -> dict:
    """Closed-loop load; samples and requests finished inside the measured window, and their latencies."""
    import httpx

    t0 = time.perf_counter() + warmup_s
    t1 = t0 + duration_s
    done = {"samples": 0, "requests": 0, "rejected": 0, "latency": []}

    async def worker(http: httpx.AsyncClient) -> None:
        while time.perf_counter() < t1:
            start = time.perf_counter()
            r = await http.post("/v1/rollouts", json={**body, "request_id": uuid.uuid4().hex})
            end = time.perf_counter()
            if r.status_code == 429:
                done["rejected"] += 1
                await asyncio.sleep(0.05)
                continue
            r.raise_for_status()
            if t0 <= end <= t1:
                done["samples"] += sum(len(g["samples"]) for g in r.json()["groups"])
                done["requests"] += 1
                done["latency"].append(end - start)

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as http:
        tasks = [asyncio.create_task(worker(http)) for _ in range(concurrency)]
        await asyncio.sleep(max(0.0, t0 - time.perf_counter()))
        with CpuMeter() as cpu:
            await asyncio.sleep(max(0.0, t1 - time.perf_counter()))
        done["cpu_busy"], done["cpu_foreign"] = cpu.busy, cpu.foreign
        await asyncio.gather(*tasks)
    return done


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", default="1,4,16", help="comma-separated replica counts; the first is the baseline")
    ap.add_argument("--token-latency-s", type=float, default=0.01)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--n", type=int, default=8, help="samples per request (one prompt)")
    ap.add_argument("--per-replica", type=int, default=4, help="concurrent clients per engine replica")
    ap.add_argument("--warmup-s", type=float, default=5.0)
    ap.add_argument("--duration-s", type=float, default=20.0)
    ap.add_argument(
        "--max-foreign",
        type=float,
        default=0.1,
        help="measure again (twice at most) if other processes used more of the cores",
    )
    args = ap.parse_args()
    counts = [int(x) for x in args.replicas.split(",")]

    body = {
        "prompts": [{"text": "Q: 37+8\nA:", "ground_truth": "45"}],
        "n": args.n,
        "reward": "gsm8k",
        "sampling_params": {"max_new_tokens": args.max_new_tokens, "ignore_eos": True, "seed": 1},
    }
    path, port, rows, runs = resolve("arith-tiny"), free_port(), [], []  # the bench engine needs only the tokenizer
    ideal_one = args.n / (args.max_new_tokens * args.token_latency_s)
    try:
        for R in counts:
            if runs:  # one Ray cluster; a fresh app per replica count
                from ray import serve

                serve.delete("farm")
            log(f"deploying {R} bench replicas")
            url = start_service(
                model=str(path),
                port=port,
                engine="bench",
                bench_token_latency_s=args.token_latency_s,
                replicas=R,
                engine_num_cpus=0,
                engine_max_ongoing_requests=2 * args.per_replica,
                engine_max_queued_requests=max(64, 4 * args.per_replica * R),
            )
            for attempt in range(3):
                wait_quiet()
                log(
                    f"{R} replicas: {args.per_replica * R} clients, "
                    f"{args.warmup_s:.0f}s warm-up + {args.duration_s:.0f}s"
                )
                res = asyncio.run(load(url, args.per_replica * R, body, args.warmup_s, args.duration_s))
                if res["cpu_foreign"] <= args.max_foreign:
                    break
                log(f"other processes used {res['cpu_foreign']:.0%} of the cores meanwhile: measuring again")
            thr = res["samples"] / args.duration_s
            lat = sorted(res["latency"]) or [float("nan")]
            runs.append(
                {
                    "replicas": R,
                    "clients": args.per_replica * R,
                    "samples_s": thr,
                    "requests": res["requests"],
                    "rejected_429": res["rejected"],
                    "latency_p50_s": lat[len(lat) // 2],
                    "latency_p95_s": lat[int(0.95 * (len(lat) - 1))],
                    "cpu_busy": res["cpu_busy"],
                    "other_processes_cpu": res["cpu_foreign"],
                    "ideal_samples_s": R * ideal_one,
                }
            )
            log(f"{R} replicas: {thr:.1f} samples/s, p50 {lat[len(lat) // 2]:.3f}s, CPU {res['cpu_busy']:.0%}")
    finally:
        stop_service()

    base = runs[0]["samples_s"] / runs[0]["replicas"]
    for run in runs:
        run["efficiency"] = run["samples_s"] / (run["replicas"] * base)
        rows.append(
            [
                run["replicas"],
                run["clients"],
                run["samples_s"],
                run["ideal_samples_s"],
                run["efficiency"],
                run["latency_p50_s"],
                run["latency_p95_s"],
                run["rejected_429"],
                f"{run['cpu_busy']:.0%}",
                f"{run['other_processes_cpu']:.0%}",
            ]
        )
    last = runs[-1]
    print(
        f"control-plane scaling: bench engine, {args.token_latency_s * 1000:g} ms/token x "
        f"{args.max_new_tokens} tokens, "
        f"1 prompt x {args.n} samples per request, {args.per_replica} clients per replica, {args.duration_s:g}s each"
    )
    print(
        table(
            [
                "replicas",
                "clients",
                "samples/s",
                "ideal",
                "efficiency",
                "p50 s",
                "p95 s",
                "429s",
                "CPU busy",
                "other procs",
            ],
            rows,
        )
    )
    met = last["efficiency"] >= 0.8
    print(f"efficiency at {last['replicas']}: {last['efficiency']:.2f}  (goal >= 0.8: {'met' if met else 'NOT met'})")
    write_json(
        "control_plane_scaling", {"args": vars(args), "runs": runs, "goal": ">= 0.8 at the largest count", "met": met}
    )


if __name__ == "__main__":
    main()
