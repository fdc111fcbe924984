"""Fair shares between tenants: does one heavy tenant slow the light ones down?

The service runs the 'bench' engine (no model: each decode step sleeps --token-latency-s), 2 replicas with
--ongoing rollout slots each. Four tenants (weight 1 each), each client posting one-prompt rollouts (n=1,
--new-tokens tokens) in a closed loop; a request answered 429 is sent again after its Retry-After (the time to its
answer counts from the first try):
  alone   three light tenants, one client each
  loaded  the same, and a heavy tenant with 10 clients: ten times the load of each light one
The figure: the light tenants' p99 latency loaded over alone, per round (--rounds, alternating which phase goes
first), the geometric mean with a 95% t interval; target <= 1.5 (holds, fails or inconclusive). Run twice:
  fair    FARM_FAIR_SHARE_SAMPLES = slots - 3: past it each tenant gets its weighted share, so a light tenant's
          request finds a free slot
  off     FARM_FAIR_SHARE_SAMPLES larger than the slots (the negative control: first come, first served)

    .venv/bin/python bench/fairness.py                  # about 6 min on 2 cores
"""

from __future__ import annotations

import argparse
import asyncio
import math
import statistics
import time

from common import TOKEN, interval, log, start_service, stop_service, table, verdict, write_json

TARGET = 1.5
LIGHT, HEAVY_CLIENTS = ("light-1", "light-2", "light-3"), 10


async def client_loop(http, headers: dict, stop_at: float, out: list[float], prompt: dict, body: dict) -> None:
    """Rollouts one after the other until stop_at; each answer's latency (from its first try) into `out`."""
    while time.monotonic() < stop_at:
        start = time.monotonic()
        while True:
            r = await http.post("/v1/rollouts", json={**body, "prompts": [prompt]}, headers=headers)
            if r.status_code != 429:
                break
            await asyncio.sleep(float(r.headers.get("retry-after", 1)))
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {r.text[:200]}")
        out.append(time.monotonic() - start)


async def phase(url: str, tokens: dict[str, str], heavy: bool, seconds: float, body: dict) -> list[float]:
    """The light tenants' latencies over `seconds`, with or without the heavy tenant."""
    import httpx

    light: list[float] = []
    stop_at = time.monotonic() + seconds
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=httpx.Limits(max_connections=64)) as http:
        jobs = [
            client_loop(http, {"Authorization": f"Bearer {tokens[t]}"}, stop_at, light, {"text": t}, body)
            for t in LIGHT
        ]
        if heavy:
            lost: list[float] = []
            head = {"Authorization": f"Bearer {tokens['heavy']}"}
            jobs += [client_loop(http, head, stop_at, lost, {"text": f"h{i}"}, body) for i in range(HEAVY_CLIENTS)]
        await asyncio.gather(*jobs)
    return light


def p99(xs: list[float]) -> float:
    return statistics.quantiles(xs, n=100)[98]


def fair_against_off(modes: dict) -> dict:
    """Does fair share lower the light tenants' ratio below first come, first served's? Welch's t-test on the log
    ratios (the two runs are separate services, so their rounds are not paired)."""
    from scipy import stats  # the bench extra

    fair, off = ([math.log(x) for x in modes[m]["ratios"]] for m in ("fair", "off"))
    test = stats.ttest_ind(fair, off, equal_var=False, alternative="less")
    return {"test": "Welch t-test, log ratio fair < off, one-sided", "p": float(test.pvalue)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--seconds", type=float, default=10.0, help="each phase's length")
    ap.add_argument(
        "--ongoing",
        type=int,
        default=2,
        help="rollout slots per replica (fewer than the 13 clients: the heavy load saturates)",
    )
    ap.add_argument("--token-latency-s", type=float, default=0.005)
    ap.add_argument("--new-tokens", type=int, default=20)
    args = ap.parse_args()

    import httpx

    slots = 2 * args.ongoing
    body = {"n": 1, "sampling_params": {"max_new_tokens": args.new_tokens, "ignore_eos": True}}
    rows, results = [], {}
    for mode, capacity in (("fair", slots - len(LIGHT)), ("off", 100 * slots)):
        url = start_service(
            engine="bench",
            replicas=2,
            engine_max_ongoing_requests=args.ongoing,
            engine_max_queued_requests=4 * slots,
            bench_token_latency_s=args.token_latency_s,
            fair_share_samples=capacity,
        )
        try:
            admin = {"Authorization": f"Bearer {TOKEN}"}
            tokens = {t: httpx.post(f"{url}/v1/tenants/{t}", headers=admin).json()["token"] for t in (*LIGHT, "heavy")}
            ratios, p99s = [], []
            asyncio.run(phase(url, tokens, False, 3.0, body))  # warm-up, unmeasured (the first phase ran slow)
            for r in range(args.rounds):
                order = (False, True) if r % 2 == 0 else (True, False)
                got = {heavy: asyncio.run(phase(url, tokens, heavy, args.seconds, body)) for heavy in order}
                ratios.append(p99(got[True]) / p99(got[False]))
                p99s.append([p99(got[False]), p99(got[True])])
                alone_ms, loaded_ms = (x * 1e3 for x in p99s[-1])
                log(f"{mode} round {r + 1}: light p99 alone {alone_ms:.0f} ms, loaded {loaded_ms:.0f} ms")
        finally:
            stop_service()
        mean, low, high = interval(ratios)
        said = verdict(1 / high, 1 / low, 1 / TARGET)  # "at most TARGET"
        alone, loaded = (statistics.median(p[i] for p in p99s) * 1e3 for i in (0, 1))
        rows.append(
            [
                mode,
                capacity,
                f"{alone:.0f} ms",
                f"{loaded:.0f} ms",
                f"{mean:.2f}",
                f"{low:.2f}-{high:.2f}",
                f"<= {TARGET}",
                said,
            ]
        )
        results[mode] = {
            "fair_share_samples": capacity,
            "ratios": ratios,
            "p99_s": p99s,
            "geometric_mean": mean,
            "ci95": [low, high],
            "verdict": said,
        }
    print(f"light tenants' p99 latency, loaded by a 10x tenant / alone; {args.rounds} rounds of {args.seconds:g} s")
    print(
        table(
            ["admission", "FARM_FAIR_SHARE_SAMPLES", "p99 alone", "p99 loaded", "ratio", "95% CI", "target", "verdict"],
            rows,
        )
    )
    compared = fair_against_off(results)
    print(f"fair share against the control: {compared['test']}, p = {compared['p']:.3g}")
    write_json(
        "fairness", {"args": vars(args), "slots": slots, "target": TARGET, "modes": results, "fair_vs_off": compared}
    )


if __name__ == "__main__":
    main()
