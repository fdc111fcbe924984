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
Each of --fronts (serve and haproxy by default: FARM_HTTP_PROXY; '+fused' adds FARM_FRONT=fused) is a pass of its
own: the service started with those settings, all its rounds, stopped (the engine arm runs in the first pass only).
The replica's busy share during each arm (farm_replica_busy_seconds: time with at least one sample generating) and
the most calls that shared one decode step are reported too, and the CPU each request costs at each process of the
service: Serve's HTTP proxy, HAProxy, the ingress replica and the engine replica (user + system CPU time, psutil,
over the arm, divided by its requests): in the many arm that is the cost of one one-sample request, in the one arm
that of one request of K samples. What they use with no request in flight (health checks, metrics, Serve's polls),
measured for IDLE_S before each arm, is taken off pro rata. "extra CPU" adds, over every process, a one-sample
request's CPU less the K-sample request's per sample: what sending samples one per request costs, wherever it is
spent (a fused front spends it in the engine replica's process).
  sessions (--sessions TOKENS) K sessions at once, each 5 turns of TOKENS tokens (token ids in), vs one K-sample
          rollout per turn with a prompt as long as a session's at that turn.

    .venv/bin/python bench/concurrency.py                            # about 15 min on 2 cores (more when busy)
    .venv/bin/python bench/concurrency.py --ks 16 64 --max-new-tokens 64 256 --rounds 7 --chat
    .venv/bin/python bench/concurrency.py --ks 16 64 --max-new-tokens 64 --rounds 1 --chat --fronts serve \
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
from overload import processes, roles

PROMPT = "Q: 12+30\nA:"
PER_ROUND = ("ratio", "many_429", "other_processes_cpu_share")  # kept per round in the JSON
FRONT = ("proxy", "haproxy", "ingress", "engine")  # the processes whose CPU per request is reported


def front_settings(front: str) -> dict:
    """A --fronts name as the service's settings: 'haproxy+fused' -> http_proxy haproxy, front fused; 'serve' ->
    http_proxy serve, front split (whatever the service's default)."""
    proxy, *options = front.split("+")
    settings: dict = {"http_proxy": proxy, "front": "split"}
    for option in options:
        if option != "fused":  # FARM_COALESCE_MS ('+coalesceMS') was measured at 2e25d28 and removed
            raise ValueError(f"unknown front option {option!r}: fused")
        settings["front"] = "fused"
    return settings


def front_settings_checked(front: str) -> str:
    try:
        settings = front_settings(front)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if settings["http_proxy"] not in ("serve", "haproxy"):
        raise argparse.ArgumentTypeError(f"{front}: starts with serve or haproxy")
    return front


def service_processes() -> dict[str, list]:
    """overload.processes() of every role a front may have (the split front's ingress, Serve's proxy actor), and
    HAProxy's (FARM_HTTP_PROXY=haproxy: a child of its manager actor)."""
    import psutil

    found = processes(roles("split", "serve"))
    found["haproxy"] = [p for p in psutil.Process().children(recursive=True) if p.name().startswith("haproxy")]
    return found


TURNS = 5  # a session's turns (--sessions)
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


REQUEST_TIMEOUT_S = 120  # a request not answered by then counts as status 0 (a hang is a figure, not a crash)


async def post(http: httpx.AsyncClient, url: str, body: dict | None = None) -> httpx.Response | int:
    """One POST: its response, or 0 when it was not answered within REQUEST_TIMEOUT_S (logged)."""
    try:
        return await http.post(url, json=body, timeout=REQUEST_TIMEOUT_S)
    except httpx.TimeoutException:
        log(f"no answer within {REQUEST_TIMEOUT_S} s: POST {url}")
        return 0


def status(answer: httpx.Response | int) -> int:
    return answer if isinstance(answer, int) else answer.status_code


async def post_all(url: str, path: str, bodies: list[dict]) -> list[int]:
    """Send the bodies at once; their status codes."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(limits=limits) as http:
        return [status(r) for r in await asyncio.gather(*[post(http, f"{url}{path}", b) for b in bodies])]


async def sessions_many(url: str, ids: list[int], k: int, sampling: dict) -> list[int]:
    """K sessions at once, each TURNS turns of one sample (token ids in: the prompt, then the prompt again after each
    answer); the status codes of their turns (a session that could not start counts as TURNS failures)."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(limits=limits) as http:

        async def session() -> list[int]:
            r = await post(http, f"{url}/v1/sessions", {"sampling_params": sampling})
            if status(r) != 200:
                return [status(r)] * TURNS
            sid, codes = r.json()["session_id"], []
            for _ in range(TURNS):
                codes.append(status(await post(http, f"{url}/v1/sessions/{sid}/generate", {"append_token_ids": ids})))
            await post(http, f"{url}/v1/sessions/{sid}/close")
            return codes

        return [c for codes in await asyncio.gather(*[session() for _ in range(k)]) for c in codes]


async def sessions_one(url: str, ids: list[int], k: int, sampling: dict) -> list[int]:
    """The same turns as one request each: TURNS rollouts of K samples in a row, the prompt as long as a session's
    at that turn (its earlier turns' tokens, as filler ids)."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    codes = []
    async with httpx.AsyncClient(limits=limits) as http:
        for turn in range(TURNS):
            prompt = ids + (ids[:1] * sampling["max_new_tokens"] + ids) * turn
            body = {"prompts": [{"token_ids": prompt}], "n": k, "sampling_params": sampling}
            codes.append(status(await post(http, f"{url}/v1/rollouts", body)))
    return codes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="arith-tiny", help="arith-tiny, smollm2 or an HF model folder")
    ap.add_argument("--ks", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--max-new-tokens", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--chat", action="store_true", help="also the OpenAI chat arms")
    ap.add_argument(
        "--sessions",
        type=int,
        default=0,
        metavar="TOKENS",
        help="also the session arms: K sessions of 5 turns of TOKENS tokens each vs a K-sample rollout per turn",
    )
    ap.add_argument(
        "--fronts",
        "--http-proxy",  # its name before the fused front: earlier figures' commands use it
        nargs="+",
        default=["serve", "haproxy"],
        type=front_settings_checked,
        help="the front designs, one pass each (the service is started again for each): FARM_HTTP_PROXY "
        "(serve or haproxy), then '+fused' for FARM_FRONT=fused, e.g. haproxy+fused",
    )
    ap.add_argument(
        "--max-foreign", type=float, default=0.25, help="redo a round in which other processes used more of the cores"
    )
    ap.add_argument("--quick", action="store_true", help="a smoke: no in-process engine arm, a short warm-up")
    ap.add_argument(
        "--out", default="concurrency", help="docs/data/OUT.json (front_designs: the comparison of the fronts)"
    )
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
        sampling = {"temperature": 1.0, "max_new_tokens": tokens, "ignore_eos": True}
        if kind == "sessions":
            requests = TURNS * (1 if arm == "one" else k)
            work = sessions_one(url, ids, k, sampling) if arm == "one" else sessions_many(url, ids, k, sampling)
        else:
            if kind == "rollouts":
                body, route = {"prompts": [{"token_ids": ids}], "sampling_params": sampling}, "/v1/rollouts"
            else:
                body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": tokens, "temperature": 1.0}
                route = "/v1/chat/completions"
            bodies = [{**body, "n": k}] if arm == "one" else [{**body, "n": 1}] * k
            requests, work = len(bodies), post_all(url, route, bodies)
        samples = k * (TURNS if kind == "sessions" else 1)
        busy0 = readyz(http, url)["busy_seconds"]
        idle0 = front_cpu(procs)  # what the front uses with no request (health checks, metrics): taken off below
        time.sleep(IDLE_S)
        cpu0, t = front_cpu(procs), time.perf_counter()
        idle = {role: (cpu0[role] - idle0[role]) / IDLE_S for role in FRONT}  # CPU s per s
        codes = asyncio.run(work)
        seconds, cpu1 = time.perf_counter() - t, front_cpu(procs)
        busy = (readyz(http, url)["busy_seconds"] - busy0) / seconds
        per_request = {
            role: 1000 * max(0.0, cpu1[role] - cpu0[role] - idle[role] * seconds) / requests for role in FRONT
        }
        return samples * codes.count(200) / len(codes) / seconds, codes, busy, per_request

    def measure(cases: list[tuple], keys: dict[tuple, tuple]) -> dict:
        """The rounds of one pass, into results[keys[case]]; the replica's state after them."""
        with httpx.Client() as http:
            log("warm-up")
            procs.clear()
            procs.update(service_processes())
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
    for i, proxy in enumerate(args.fronts):
        kinds = served + (["engine"] if i == 0 and not args.quick else [])  # in process once: no proxy in its way
        cases = [(kind, tokens, k) for kind in kinds for tokens in args.max_new_tokens for k in args.ks]
        cases += [("sessions", args.sessions, k) for k in args.ks] if args.sessions else []
        keys = {case: (case[0] if case[0] == "engine" else f"{proxy}:{case[0]}", *case[1:]) for case in cases}
        results |= {keys[case]: [] for case in cases}
        log(f"pass {i + 1}/{len(args.fronts)}: {proxy} ({front_settings(proxy)})")
        url = start_service(
            model=str(path), replicas=1, engine_threads=args.threads, engine_num_cpus=1, **front_settings(proxy)
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
            # every process's CPU per one-sample request beyond the K-sample request's per sample: what sending the
            # samples one per request costs, wherever it is spent (a fused front spends it in the engine's process)
            s["median_extra_cpu_ms_per_request"] = round(
                statistics.median(
                    sum(r[f"{ro}_cpu_ms_per_request_many"] - r[f"{ro}_cpu_ms_per_request_one"] / k for ro in FRONT)
                    for r in rs
                ),
                2,
            )
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
                "/".join(f"{cpu[f'{role}_many']:.1f}" for role in FRONT) if cpu else "-",
                f"{s['median_extra_cpu_ms_per_request']:.1f}" if cpu else "-",
            ]
        )
    met = {
        f"{proxy} {tokens}tok": all(
            summary[f"{proxy}:rollouts_{tokens}tok_k{k}"]["median_ratio"] >= 0.8 for k in args.ks
        )
        for proxy in args.fronts
        for tokens in args.max_new_tokens
    }
    most = {proxy: r["batch_calls"]["max"] for proxy, r in replica.items()}
    print(
        f"concurrency: {args.model}, 1 replica, {args.threads} threads, {args.rounds} rounds; "
        f"most calls in one decode step on the replica: {most}"
    )
    headers = ["arm", "tokens", "K", "one req samples/s", "K reqs samples/s", "ratio", "range", "429s", "busy one/many"]
    headers += ["CPU ms/req proxy/haproxy/ingress/engine, n=1 reqs", "extra CPU ms per n=1 req, all"]
    print(table(headers, rows))
    print("goal >= 0.8 at every K (rollouts): " + ", ".join(f"{t} {'met' if v else 'NOT met'}" for t, v in met.items()))
    if args.quick:
        log(f"--quick: docs/data/{args.out}.json left as it was")
        return
    write_json(
        args.out,
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
