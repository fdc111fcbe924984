"""Concurrent requests sharing batches: samples/s of K concurrent one-sample requests / one request of K samples.

One engine replica of the model (default arith-tiny; the service's default settings otherwise: 64 rollouts in
flight per replica, 64 queued), K in --ks (16 and 64), samples of each length in --max-new-tokens. Each round runs,
for each case, two arms back to back, their order alternating from round to round:
  one    POST /v1/rollouts with one prompt (token ids, as RL clients send) and n=K
  many   K concurrent POST /v1/rollouts, each with that prompt and n=1 (httpx, one connection each)
with temperature 1 and ignore_eos, so every sample has exactly max_new_tokens tokens and both arms do the same
work. The figure is, per case, the median over --rounds rounds of many / one (samples/s), with its range; the
429s the many arm drew are counted (goal: none, the defaults admit 64 + 64 calls on one replica).
  engine  the same two arms in process, on a TorchEngine of the same model and threads (K agenerate calls at once
          vs one call of K rows), while the service idles: the engine's batching alone, without the service's
          per-request cost (HTTP, Serve's proxy, the ingress, two Ray calls).
  chat    (--chat) K concurrent POST /v1/chat/completions vs one with n=K; OpenAI's API has no ignore_eos, so
          samples end at EOS and the lengths, and the figure, vary more.
Each of --http-proxy (serve, haproxy) is a pass of its own: the service started with that FARM_HTTP_PROXY, all
its rounds, stopped (the engine arm runs in the first pass only). The replica's busy share during each arm
(farm_replica_busy_seconds: time with at least one sample generating) and the most calls that shared one decode
step are reported too, and the CPU each request costs at Serve's HTTP proxy and at the ingress replica (user + system
CPU time of their processes, psutil, over the arm, divided by its requests): in the many arm that is the cost of one
one-sample request, in the one arm that of one request of K samples. What the two use with no request in flight
(health checks, metrics, Serve's polls), measured for IDLE_S before each arm, is taken off pro rata.

    .venv/bin/python bench/concurrency.py                            # about 15 min on 2 cores (more when busy)
    .venv/bin/python bench/concurrency.py --ks 16 64 --max-new-tokens 64 256 --rounds 7 --chat
    .venv/bin/python bench/concurrency.py --ks 16 64 --max-new-tokens 64 --rounds 1 --chat --http-proxy serve \
        --max-foreign 1 --quick                                      # a smoke (a few minutes; figures noisy)
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
from overload import processes

PROMPT = "Q: 12+30\nA:"
PER_ROUND = ("ratio", "many_429", "other_processes_cpu_share")  # kept per round in the JSON
FRONT = ("proxy", "ingress")  # the processes whose CPU per request is reported
IDLE_S = 1.0  # before each HTTP arm: the front's CPU with no request in flight, per second, taken off the arm's


def front_cpu(procs: dict[str, list]) -> dict[str, float]:
    """role -> CPU seconds (user + system) its processes have used."""
    out = {}
    for role in FRONT:
        total = 0.0
        for p in procs[role]:
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except Exception:  # the process ended (a replica restarted): its time is lost to the figure
                continue
        out[role] = total
    return out


def readyz(http: httpx.Client, url: str) -> dict:
    r = http.get(f"{url}/readyz", timeout=60)
    r.raise_for_status()
    (replica,) = r.json()["replicas"]
    return replica


async def post_all(url: str, path: str, bodies: list[dict]) -> list[int]:
    """Send the bodies at once; their status codes."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        answers = await asyncio.gather(*[http.post(f"{url}{path}", json=b) for b in bodies])
        return [r.status_code for r in answers]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="arith-tiny", help="arith-tiny, smollm2 or an HF model folder")
    ap.add_argument("--ks", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--max-new-tokens", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--chat", action="store_true", help="also the OpenAI chat arms")
    ap.add_argument(
        "--http-proxy",
        nargs="+",
        default=["serve", "haproxy"],
        choices=["serve", "haproxy"],
        help="FARM_HTTP_PROXY of the service, one pass each (the service is started again for each)",
    )
    ap.add_argument(
        "--max-foreign", type=float, default=0.25, help="redo a round in which other processes used more of the cores"
    )
    ap.add_argument("--quick", action="store_true", help="a smoke: no in-process engine arm, a short warm-up")
    args = ap.parse_args()

    from rollout_farm.services.engine.torch import TorchEngine
    from rollout_farm.services.protocol import SamplingParams

    path = resolve(args.model)
    engine = TorchEngine(str(path), "cpu", "float32", args.threads)
    url = ""  # the service of the pass under way
    ids = engine.tokenizer(PROMPT, add_special_tokens=False).input_ids

    procs: dict[str, list] = {}  # the front's processes in the pass under way

    def run(kind: str, tokens: int, k: int, arm: str, http: httpx.Client) -> tuple[float, list[int], float, dict]:
        """(samples/s, status codes, busy share, {role: CPU ms per request}) of one arm."""
        if kind == "engine":
            p = SamplingParams(temperature=1.0, max_new_tokens=tokens, ignore_eos=True)
            busy0, t = engine.stats.busy_seconds, time.perf_counter()
            if arm == "one":
                engine.generate([ids] * k, p)
            else:

                async def calls():
                    return await asyncio.gather(*[engine.agenerate([ids], p) for _ in range(k)])

                asyncio.run(calls())
            seconds = time.perf_counter() - t
            return k / seconds, [200] * (1 if arm == "one" else k), (engine.stats.busy_seconds - busy0) / seconds, {}
        if kind == "rollouts":
            sampling = {"temperature": 1.0, "max_new_tokens": tokens, "ignore_eos": True}
            body, route = {"prompts": [{"token_ids": ids}], "sampling_params": sampling}, "/v1/rollouts"
        else:
            body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": tokens, "temperature": 1.0}
            route = "/v1/chat/completions"
        bodies = [{**body, "n": k}] if arm == "one" else [{**body, "n": 1}] * k
        busy0 = readyz(http, url)["busy_seconds"]
        idle0 = front_cpu(procs)  # what the front uses with no request (health checks, metrics): taken off below
        time.sleep(IDLE_S)
        cpu0, t = front_cpu(procs), time.perf_counter()
        idle = {role: (cpu0[role] - idle0[role]) / IDLE_S for role in FRONT}  # CPU s per s
        codes = asyncio.run(post_all(url, route, bodies))
        seconds, cpu1 = time.perf_counter() - t, front_cpu(procs)
        busy = (readyz(http, url)["busy_seconds"] - busy0) / seconds
        per_request = {
            role: 1000 * max(0.0, cpu1[role] - cpu0[role] - idle[role] * seconds) / len(bodies) for role in FRONT
        }
        return k * codes.count(200) / len(codes) / seconds, codes, busy, per_request

    def measure(cases: list[tuple], keys: dict[tuple, tuple]) -> dict:
        """The rounds of one pass, into results[keys[case]]; the replica's state after them."""
        with httpx.Client() as http:
            log("warm-up")
            procs.clear()
            procs.update(processes())
            for kind in {case[0] for case in cases}:
                for arm in ("one", "many"):
                    run(kind, min(args.max_new_tokens), min(args.ks) if args.quick else max(args.ks), arm, http)
            rounds, redone = 0, 0
            while rounds < args.rounds:
                wait_quiet(threshold=args.max_foreign, max_wait_s=60)
                order = ("one", "many") if rounds % 2 == 0 else ("many", "one")
                with CpuMeter() as m:
                    measured = {(*case, arm): run(*case, arm, http) for case in cases for arm in order}
                if m.foreign > args.max_foreign and redone < 2 * args.rounds:
                    redone += 1
                    log(f"other processes used {m.foreign:.0%} of the cores during the round: measuring it again")
                    continue
                rounds += 1
                for case in cases:
                    (one, _, busy_one, cpu_one), (many, codes, busy_many, cpu_many) = (
                        measured[(*case, "one")],
                        measured[(*case, "many")],
                    )
                    results[keys[case]].append(
                        {
                            "one_samples_s": one,
                            "many_samples_s": many,
                            "ratio": many / one,
                            "many_429": codes.count(429),
                            "many_other_errors": sum(c not in (200, 429) for c in codes),
                            "busy_share_one": busy_one,
                            "busy_share_many": busy_many,
                            "other_processes_cpu_share": m.foreign,
                            **{f"{role}_cpu_ms_per_request_one": v for role, v in cpu_one.items()},
                            **{f"{role}_cpu_ms_per_request_many": v for role, v in cpu_many.items()},
                        }
                    )
                log(
                    f"round {rounds}/{args.rounds}: "
                    + ", ".join(f"{c[0]} {c[1]} tok K={c[2]} {results[keys[c]][-1]['ratio']:.2f}" for c in cases)
                )
            return readyz(http, url)

    served = ["rollouts"] + (["chat"] if args.chat else [])
    results: dict[tuple, list[dict]] = {}
    replica: dict[str, dict] = {}
    for i, proxy in enumerate(args.http_proxy):
        kinds = served + (["engine"] if i == 0 and not args.quick else [])  # in process once: no proxy in its way
        cases = [(kind, tokens, k) for kind in kinds for tokens in args.max_new_tokens for k in args.ks]
        keys = {case: (case[0] if case[0] == "engine" else f"{proxy}:{case[0]}", *case[1:]) for case in cases}
        results |= {keys[case]: [] for case in cases}
        log(f"pass {i + 1}/{len(args.http_proxy)}: FARM_HTTP_PROXY={proxy}")
        url = start_service(
            model=str(path), replicas=1, engine_threads=args.threads, engine_num_cpus=1, http_proxy=proxy
        )
        try:
            replica[proxy] = measure(cases, keys)
        finally:
            stop_service()

    rows, summary = [], {}
    for (kind, tokens, k), rs in results.items():
        ratios = [r["ratio"] for r in rs]
        s = summary[f"{kind}_{tokens}tok_k{k}"] = {
            "median_ratio": statistics.median(ratios),
            "range": [min(ratios), max(ratios)],
            "median_one_samples_s": statistics.median(r["one_samples_s"] for r in rs),
            "median_many_samples_s": statistics.median(r["many_samples_s"] for r in rs),
            "many_429_total": sum(r["many_429"] for r in rs),
            "many_other_errors_total": sum(r["many_other_errors"] for r in rs),
            "median_busy_share_one": statistics.median(r["busy_share_one"] for r in rs),
            "median_busy_share_many": statistics.median(r["busy_share_many"] for r in rs),
            "per_round": {key: [round(r[key], 3) for r in rs] for key in PER_ROUND},  # in round order
        }
        if kind != "engine":  # CPU ms per request at the front: one-sample requests (many), a K-sample one (one)
            s["median_cpu_ms_per_request"] = {
                f"{role}_{arm}": round(statistics.median(r[f"{role}_cpu_ms_per_request_{arm}"] for r in rs), 2)
                for arm in ("many", "one")
                for role in FRONT
            }
        cpu = s.get("median_cpu_ms_per_request")
        rows.append(
            [
                kind,
                tokens,
                k,
                s["median_one_samples_s"],
                s["median_many_samples_s"],
                s["median_ratio"],
                f"{min(ratios):.3f}-{max(ratios):.3f}",
                s["many_429_total"] if kind != "engine" else "-",
                f"{s['median_busy_share_one']:.2f}/{s['median_busy_share_many']:.2f}",
                f"{cpu['proxy_many']:.1f}/{cpu['ingress_many']:.1f}" if cpu else "-",
                f"{cpu['proxy_one']:.1f}/{cpu['ingress_one']:.1f}" if cpu else "-",
            ]
        )
    met = {
        f"{proxy} {tokens}tok": all(
            summary[f"{proxy}:rollouts_{tokens}tok_k{k}"]["median_ratio"] >= 0.8 for k in args.ks
        )
        for proxy in args.http_proxy
        for tokens in args.max_new_tokens
    }
    most = {proxy: r["batch_calls"]["max"] for proxy, r in replica.items()}
    print(
        f"concurrency: {args.model}, 1 replica, {args.threads} threads, {args.rounds} rounds; "
        f"most calls in one decode step on the replica: {most}"
    )
    headers = ["arm", "tokens", "K", "one req samples/s", "K reqs samples/s", "ratio", "range", "429s", "busy one/many"]
    headers += ["CPU ms/req proxy/ingress, n=1 reqs", "same, the n=K req"]
    print(table(headers, rows))
    print("goal >= 0.8 at every K (rollouts): " + ", ".join(f"{t} {'met' if v else 'NOT met'}" for t, v in met.items()))
    if args.quick:
        log("--quick: docs/data/concurrency.json left as it was")
        return
    write_json(
        "concurrency",
        {
            "args": vars(args),
            "model_path": str(path),
            "max_calls_in_a_step": most,
            "results": summary,
            "goal": ">= 0.8 at K = 16 and 64 (rollouts)",
            "met": met,
        },
    )


if __name__ == "__main__":
    main()
