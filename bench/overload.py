"""Overload: status mix, latency and memory when clients offer 1x, 3x and 10x what the service admits.

The service runs the 'bench' engine (no model: each decode step sleeps --token-latency-s, shared by every call
in the step), --replicas engine replicas, FARM_ENGINE_MAX_ONGOING_REQUESTS=--ongoing and
FARM_ENGINE_MAX_QUEUED_REQUESTS=--queued. What it admits at once (running or waiting, not answered 429):
  per replica   --ongoing rollouts running + its share of --queued waiting for a slot (more: the replica answers Full)
  the ingress   Serve's queue for the replicas, a backstop larger than what the replicas admit, and up to
                FARM_INGRESS_MAX_ONGOING_REQUESTS requests in the ingress (each engine replica with --front
                fused); past those the replica or Serve's proxy holds them
  capacity = replicas * ongoing + queued (each replica holds its share of the queue)
For each multiple k of --levels, k * capacity concurrent clients post one-prompt rollouts in a closed loop for
--duration-s (after --warmup-s); a client answered 429 comes back after 50 ms, not after Retry-After: harder than a
well-behaved client. Meanwhile psutil samples the resident memory of each engine replica, the ingress replica (the
split front) and the HTTP proxy (Serve's proxy actor, or HAProxy's manager actor and the haproxy process) every
0.25 s. Reported per level: the status mix (200 / 429 / anything else, which must be 0,
timeouts included), p50 and p99 latency of the 200s, 200s per second, the peak RSS of each process, the 429s the
ingress counted (farm_overload_rejections_total), and the share of the cores other processes used meanwhile (on a
shared machine they skew the latencies). The idle RSS before the first and after the last level shows what stays.
--front and --http-proxy run the service on another HTTP front (docs/data/overload-<front>-<proxy>.json).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import threading
import time
from collections import Counter

from common import CpuMeter, add_front_args, data_name, log, start_service, stop_service, table, write_json


def roles(front: str, http_proxy: str) -> dict[str, str]:
    """role -> what its processes' command lines hold: the engine replicas; the ingress replicas with the split front;
    Serve's proxy actor, or with HAProxy its manager actor and the haproxy process itself."""
    out = {"engine": "ServeReplica:farm:engine"}
    if front == "split":
        out["ingress"] = "ServeReplica:farm:ingress"
    if http_proxy == "serve":
        out["proxy"] = "ProxyActor"
    else:
        out |= {"proxy": "HAProxyManager", "haproxy": "bin/haproxy "}
    return out


def processes(roles: dict[str, str]) -> dict[str, list]:
    """role -> the psutil processes of this script's service: Ray names its workers by actor class in their command
    line, and this script's Ray cluster is its own descendants (other people's clusters on the machine are not)."""
    import psutil

    found: dict[str, list] = {role: [] for role in roles}
    for p in psutil.Process().children(recursive=True):
        try:
            line = " ".join(p.cmdline())
        except psutil.Error:
            continue
        for role, tag in roles.items():
            if tag in line:
                found[role].append(p)
    return found


def rss_mib(procs: dict[str, list]) -> dict[str, float]:
    """role -> the largest RSS among its processes, MiB."""
    out = {}
    for role, ps in procs.items():
        sizes = []
        for p in ps:
            try:
                sizes.append(p.memory_info().rss / 2**20)
            except Exception:  # the process ended: a replica restarted
                continue
        out[role] = max(sizes, default=0.0)
    return out


class PeakRss:
    """Samples rss_mib() in a thread until stopped; the peak per role."""

    def __init__(self, procs: dict[str, list], every_s: float = 0.25):
        self.procs, self.every_s, self.peak = procs, every_s, dict.fromkeys(procs, 0.0)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        while not self.stop.is_set():
            for role, mib in rss_mib(self.procs).items():
                self.peak[role] = max(self.peak[role], mib)
            self.stop.wait(self.every_s)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


def rejections(url: str) -> float:
    import httpx

    lines = httpx.get(f"{url}/metrics", timeout=60).text.splitlines()
    return sum(float(x.rsplit(" ", 1)[1]) for x in lines if x.startswith("farm_overload_rejections_total{"))


async def offer(url: str, clients: int, body: dict, warmup_s: float, duration_s: float) -> dict:
    """`clients` closed-loop clients; what was answered inside the measured window."""
    import httpx

    t0 = time.perf_counter() + warmup_s
    t1 = t0 + duration_s
    statuses: Counter = Counter()
    latencies: list[float] = []

    async def client(http: httpx.AsyncClient) -> None:
        while time.perf_counter() < t1:
            start = time.perf_counter()
            try:
                r = await http.post("/v1/rollouts", json=body)
                status = r.status_code
            except httpx.HTTPError as e:
                status = type(e).__name__
            end = time.perf_counter()
            if t0 <= end <= t1:
                statuses[status] += 1
                if status == 200:
                    latencies.append(end - start)
            if status != 200:
                await asyncio.sleep(0.05)

    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as http:
        await asyncio.gather(*[client(http) for _ in range(clients)])
    return {"statuses": statuses, "latencies": latencies}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--ongoing", type=int, default=4, help="FARM_ENGINE_MAX_ONGOING_REQUESTS")
    ap.add_argument("--queued", type=int, default=8, help="FARM_ENGINE_MAX_QUEUED_REQUESTS")
    ap.add_argument(
        "--levels", default="1,3,10,10", help="offered load as multiples of the capacity (10 twice: does it grow?)"
    )
    ap.add_argument("--token-latency-s", type=float, default=0.01)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--n", type=int, default=4, help="samples per request (one prompt)")
    ap.add_argument("--warmup-s", type=float, default=3.0)
    ap.add_argument("--duration-s", type=float, default=15.0)
    add_front_args(ap)
    args = ap.parse_args()

    capacity = args.replicas * args.ongoing + args.queued
    body = {
        "prompts": [{"token_ids": [40, 41, 42]}],
        "n": args.n,
        "sampling_params": {"max_new_tokens": args.max_new_tokens, "ignore_eos": True, "seed": 1},
    }
    url = start_service(
        engine="bench",
        replicas=args.replicas,
        engine_num_cpus=0,
        engine_max_ongoing_requests=args.ongoing,
        engine_max_queued_requests=args.queued,
        bench_token_latency_s=args.token_latency_s,
        front=args.front,
        http_proxy=args.http_proxy,
        log_level="WARNING",
    )
    rows, levels = [], []
    try:
        expected = roles(args.front, args.http_proxy)
        procs = processes(expected)
        log("processes: " + ", ".join(f"{role} {len(ps)}" for role, ps in procs.items()))
        counts = {role: len(ps) for role, ps in procs.items()}
        assert counts == {role: args.replicas if role == "engine" else 1 for role in expected}, counts
        asyncio.run(offer(url, 4, body, 0.0, 2.0))  # warm the routes and the replicas
        idle_before = rss_mib(procs)
        for k in [int(x) for x in args.levels.split(",")]:
            clients = k * capacity
            log(f"{k}x capacity: {clients} clients for {args.warmup_s + args.duration_s:.0f}s")
            counted = rejections(url)
            with PeakRss(procs) as peak, CpuMeter() as cpu:
                got = asyncio.run(offer(url, clients, body, args.warmup_s, args.duration_s))
            st, lat = got["statuses"], sorted(got["latencies"])
            other = sum(v for s, v in st.items() if s not in (200, 429))
            p50 = statistics.median(lat) if lat else float("nan")
            p99 = lat[min(len(lat) - 1, int(0.99 * len(lat)))] if lat else float("nan")
            level = {
                "multiple": k,
                "clients": clients,
                "ok_200": st[200],
                "rejected_429": st[429],
                "other": other,
                "other_kinds": {str(s): v for s, v in st.items() if s not in (200, 429)},
                "ok_per_s": st[200] / args.duration_s,
                "p50_latency_s": p50,
                "p99_latency_s": p99,
                "peak_rss_mib": peak.peak,
                "rejections_counted_in_level": rejections(url) - counted,  # warm-up and tail included
                "cpu_busy": cpu.busy,  # share of all cores, this run and everything else
                "cpu_other_processes": cpu.foreign,  # share of all cores other people's processes used meanwhile
            }
            levels.append(level)
            rows.append(
                [k, clients, st[200], st[429], other, level["ok_per_s"], p50, p99]
                + [peak.peak[r] for r in expected]
                + [cpu.foreign]
            )
            log(f"{k}x: 200={st[200]} 429={st[429]} other={other} p50={p50:.3f}s peak RSS {peak.peak}")
        time.sleep(3)
        idle_after = rss_mib(procs)
    finally:
        stop_service()

    print(
        f"overload: bench engine {args.token_latency_s * 1000:g} ms x {args.max_new_tokens} tokens, n={args.n}, "
        f"{args.replicas} replicas, ongoing {args.ongoing}, queued {args.queued}: capacity {capacity}; "
        f"{args.duration_s:g} s per level"
    )
    heads = ["x", "clients", "200", "429", "other", "200/s", "p50 s", "p99 s"]
    print(table(heads + [f"{r} MiB" for r in expected] + ["other procs CPU"], rows))
    print(f"idle RSS MiB before: {idle_before}\nidle RSS MiB after:  {idle_after}")
    write_json(
        data_name("overload", args.front, args.http_proxy),
        {
            "args": vars(args),
            "capacity": capacity,
            "capacity_formula": "replicas * ongoing + queued",
            "levels": levels,
            "idle_rss_mib_before": idle_before,
            "idle_rss_mib_after": idle_after,
            "other_statuses_total": sum(lv["other"] for lv in levels),
        },
    )


if __name__ == "__main__":
    main()
