"""Concurrent requests sharing batches: samples/s of K concurrent one-sample requests / one request of K samples.

One engine replica of the model (default arith-tiny, the service's default settings otherwise), K in --ks (16 and
64). Each round runs, for each K, two arms back to back, their order alternating from round to round:
  one    POST /v1/rollouts with one prompt and n=K
  many   K concurrent POST /v1/rollouts, each with the same prompt and n=1 (httpx, one connection each)
with temperature 1, --max-new-tokens and ignore_eos, so every sample has exactly that many tokens and both arms do
the same work. The figure is, per K, the median over --rounds rounds of many / one (samples/s), with its range;
the 429s the many arm drew are counted (goal: none, the default limits admit 64 + 64 calls per replica). With
--chat the same two arms go through POST /v1/chat/completions (K requests vs one with n=K; max_tokens, no
ignore_eos in OpenAI's API: lengths vary, so that figure is noisier). The replica's busy share during each arm
(farm_replica_busy_seconds) and the most calls that shared one decode step are reported too.

    .venv/bin/python bench/concurrency.py                  # about 3 min on 2 cores
    .venv/bin/python bench/concurrency.py --ks 16 64 --rounds 9 --chat
Goal: >= 0.8 at both K.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time

import httpx
from common import CpuMeter, log, resolve, start_service, stop_service, table, wait_quiet, write_json

PROMPT = "Q: 12+30\nA:"


def readyz(http: httpx.Client, url: str) -> dict:
    r = http.get(f"{url}/readyz", timeout=60)
    r.raise_for_status()
    (replica,) = r.json()["replicas"]
    return replica


async def arm(url: str, path: str, bodies: list[dict]) -> tuple[float, list[int]]:
    """Send the bodies at once; (seconds until the last answer, status codes)."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        t = time.perf_counter()
        answers = await asyncio.gather(*[http.post(f"{url}{path}", json=b) for b in bodies])
        return time.perf_counter() - t, [r.status_code for r in answers]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="arith-tiny", help="arith-tiny, smollm2 or an HF model folder")
    ap.add_argument("--ks", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--chat", action="store_true", help="also the OpenAI chat arms")
    ap.add_argument(
        "--max-foreign", type=float, default=0.25, help="redo a round in which other processes used more of the cores"
    )
    args = ap.parse_args()

    path = resolve(args.model)
    url = start_service(model=str(path), replicas=1, engine_threads=args.threads, engine_num_cpus=1)
    sampling = {"temperature": 1.0, "max_new_tokens": args.max_new_tokens, "ignore_eos": True}
    chat = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": args.max_new_tokens, "temperature": 1.0}

    def bodies(kind: str, k: int) -> tuple[str, dict[str, list[dict]]]:
        if kind == "rollouts":
            body = {"prompts": [{"text": PROMPT}], "sampling_params": sampling}
            return "/v1/rollouts", {"one": [{**body, "n": k}], "many": [{**body, "n": 1}] * k}
        return "/v1/chat/completions", {"one": [{**chat, "n": k}], "many": [chat] * k}

    kinds = ["rollouts", "chat"] if args.chat else ["rollouts"]
    results: dict[tuple[str, int], list[dict]] = {(kind, k): [] for kind in kinds for k in args.ks}
    try:
        with httpx.Client() as http:
            log("warm-up")
            for kind in kinds:
                p, arms = bodies(kind, max(args.ks))
                for name in ("one", "many"):
                    asyncio.run(arm(url, p, arms[name]))
            rounds, redone = 0, 0
            while rounds < args.rounds:
                wait_quiet(threshold=args.max_foreign, max_wait_s=60)
                order = ("one", "many") if rounds % 2 == 0 else ("many", "one")
                measured = {}
                with CpuMeter() as m:
                    for kind in kinds:
                        for k in args.ks:
                            p, arms = bodies(kind, k)
                            for name in order:
                                busy0 = readyz(http, url)["busy_seconds"]
                                seconds, codes = asyncio.run(arm(url, p, arms[name]))
                                busy = (readyz(http, url)["busy_seconds"] - busy0) / seconds
                                measured[kind, k, name] = (k * codes.count(200) / len(codes) / seconds, codes, busy)
                if m.foreign > args.max_foreign and redone < 2 * args.rounds:
                    redone += 1
                    log(f"other processes used {m.foreign:.0%} of the cores during the round: measuring it again")
                    continue
                rounds += 1
                for kind in kinds:
                    for k in args.ks:
                        (one, _, busy_one), (many, codes, busy_many) = (
                            measured[kind, k, "one"],
                            measured[kind, k, "many"],
                        )
                        results[kind, k].append(
                            {
                                "one_samples_s": one,
                                "many_samples_s": many,
                                "ratio": many / one,
                                "many_429": codes.count(429),
                                "many_other_errors": sum(c not in (200, 429) for c in codes),
                                "busy_share_one": busy_one,
                                "busy_share_many": busy_many,
                                "other_processes_cpu_share": m.foreign,
                            }
                        )
                        n429 = codes.count(429)
                        log(f"round {rounds}/{args.rounds} {kind} K={k}: ratio {many / one:.3f}, {n429} 429s")
            replica = readyz(http, url)
    finally:
        stop_service()

    rows, summary = [], {}
    for (kind, k), rs in results.items():
        ratios = [r["ratio"] for r in rs]
        med = statistics.median(ratios)
        summary[f"{kind}_k{k}"] = {
            "median_ratio": med,
            "range": [min(ratios), max(ratios)],
            "median_one_samples_s": statistics.median(r["one_samples_s"] for r in rs),
            "median_many_samples_s": statistics.median(r["many_samples_s"] for r in rs),
            "many_429_total": sum(r["many_429"] for r in rs),
            "many_other_errors_total": sum(r["many_other_errors"] for r in rs),
            "median_busy_share_one": statistics.median(r["busy_share_one"] for r in rs),
            "median_busy_share_many": statistics.median(r["busy_share_many"] for r in rs),
            "rounds": rs,
        }
        s = summary[f"{kind}_k{k}"]
        rows.append(
            [
                kind,
                k,
                s["median_one_samples_s"],
                s["median_many_samples_s"],
                med,
                f"{min(ratios):.3f}-{max(ratios):.3f}",
                s["many_429_total"],
                f"{s['median_busy_share_one']:.2f}/{s['median_busy_share_many']:.2f}",
            ]
        )
    met = all(summary[f"rollouts_k{k}"]["median_ratio"] >= 0.8 for k in args.ks)
    print(
        f"concurrency: {args.model}, 1 replica, {args.max_new_tokens} tokens per sample, {args.threads} threads, "
        f"{args.rounds} rounds; most calls in one decode step: {replica['batch_calls']['max']}"
    )
    headers = ["endpoint", "K", "one req samples/s", "K reqs samples/s", "ratio", "range", "429s", "busy one/many"]
    print(table(headers, rows))
    print(f"goal >= 0.8 at every K (rollouts): {'met' if met else 'NOT met'}")
    write_json(
        "concurrency",
        {
            "args": vars(args),
            "model_path": str(path),
            "max_calls_in_a_step": replica["batch_calls"]["max"],
            "results": summary,
            "goal": ">= 0.8 at K = 16 and 64",
            "met": met,
        },
    )


if __name__ == "__main__":
    main()
