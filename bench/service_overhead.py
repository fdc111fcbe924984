"""Service overhead: samples/s through the REST API vs the same engine called in process.

One batch (P prompts x n samples, SamplingParams with a seed, fixed max_new_tokens, ignore_eos, so every
sample has exactly max_new_tokens tokens) is generated
  REST        FarmClient.rollouts against the real service started here (1 engine replica, --threads
              torch threads), prompts sent as token ids, no reward; on top of the engine it pays
              for HTTP, Ray calls, decoding samples to text and (de)serializing the answer;
  in-process  TorchEngine(same model, same threads).generate on the same token ids.
The two sides alternate (A B, B A, A B, ...) for --rounds rounds of --reps calls each, so they never run
at the same time; the figure is the median over rounds of REST samples/s / in-process samples/s.
Other jobs on a small machine skew both sides: each round first waits until other processes are idle,
and a round in which they used more than --max-foreign of the cores is measured again.
Goal: >= 0.99, judged on the geometric mean's 95% t interval over rounds (holds, fails or inconclusive).
--front and --http-proxy run the service on another HTTP front (docs/data/service_overhead-<front>-<proxy>.json).
"""

from __future__ import annotations

import argparse
import os
import time

from common import (
    TOKEN,
    CpuMeter,
    add_front_args,
    data_name,
    interval,
    log,
    quartiles,
    resolve,
    start_service,
    stop_service,
    table,
    verdict,
    wait_quiet,
    write_json,
)

GOAL = 0.99


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="arith-tiny", help="arith-tiny, smollm2 or an HF model folder")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--reps", type=int, default=2, help="calls per side per round")
    ap.add_argument(
        "--max-foreign", type=float, default=0.1, help="redo a round in which other processes used more of the cores"
    )
    add_front_args(ap)
    args = ap.parse_args()

    from rollout_farm.services.client import FarmClient
    from rollout_farm.services.engine.torch import TorchEngine
    from rollout_farm.services.protocol import Prompt, RolloutRequest, SamplingParams

    path = resolve(args.model)
    url = start_service(
        model=str(path),
        replicas=1,
        engine_threads=args.threads,
        engine_num_cpus=1,
        front=args.front,
        http_proxy=args.http_proxy,
    )
    try:
        engine = TorchEngine(str(path), "cpu", "float32", args.threads)
        ids = [
            engine.tokenizer(f"Q: {10 + i % 90}+{i % 10}\nA:", add_special_tokens=False).input_ids
            for i in range(args.prompts)
        ]
        params = SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens, ignore_eos=True, seed=1)
        req = RolloutRequest(prompts=[Prompt(token_ids=x) for x in ids], n=args.n, sampling_params=params)
        batch = [x for x in ids for _ in range(args.n)]
        samples = len(batch)

        with FarmClient(url, TOKEN) as client:

            def rest() -> int:
                groups = client.rollouts(req).groups
                return sum(len(s.token_ids) for g in groups for s in g.samples)

            def local() -> int:
                return sum(len(o.token_ids) for o in engine.generate(batch, params))

            def timed(fn) -> tuple[float, float]:
                """samples/s over --reps calls, and the share of the cores other processes used meanwhile."""
                with CpuMeter() as m:
                    t = time.perf_counter()
                    for _ in range(args.reps):
                        tokens = fn()
                        assert tokens == samples * args.max_new_tokens, (
                            f"{tokens} tokens, expected {samples * args.max_new_tokens}"
                        )
                    rate = args.reps * samples / (time.perf_counter() - t)
                return rate, m.foreign

            log("warm-up")
            rest(), local()
            rows, redone = [], 0
            while len(rows) < args.rounds:
                wait_quiet()
                a, b = (rest, local) if len(rows) % 2 == 0 else (local, rest)  # alternate which side goes first
                res = {fn: timed(fn) for fn in (a, b)}
                foreign = max(res[rest][1], res[local][1])
                if foreign > args.max_foreign and redone < 2 * args.rounds:
                    redone += 1
                    log(f"other processes used {foreign:.0%} of the cores during the round: measuring it again")
                    continue
                rows.append([len(rows) + 1, res[rest][0], res[local][0], res[rest][0] / res[local][0], foreign])
                log(f"round {len(rows)}/{args.rounds}: REST {res[rest][0]:.1f}/s, in-process {res[local][0]:.1f}/s")
    finally:
        stop_service()

    q1, ratio, q3 = quartiles([row[3] for row in rows])
    print(
        f"service overhead: {args.model}, {args.prompts} prompts x {args.n} samples x {args.max_new_tokens} tokens, "
        f"{args.threads} threads, {args.reps} calls per side per round"
    )
    print(table(["round", "REST samples/s", "in-process samples/s", "ratio", "other procs CPU"], rows))
    mean, low, high = interval([row[3] for row in rows])
    judged = verdict(low, high, GOAL)
    print(
        f"median ratio REST / in-process: {ratio:.3f}, quartiles {q1:.3f}-{q3:.3f}; geometric mean {mean:.3f} "
        f"(95% CI {low:.3f}-{high:.3f}): goal >= {GOAL}: {judged}"
    )
    keys = ["round", "rest_samples_s", "inprocess_samples_s", "ratio", "other_processes_cpu_share"]
    write_json(
        data_name("service_overhead", args.front, args.http_proxy),
        {
            "args": vars(args),
            "model_path": str(path),
            "samples_per_call": samples,
            "rounds": [dict(zip(keys, r)) for r in rows],
            "median_ratio": ratio,
            "quartiles": [q1, q3],
            "geometric_mean": mean,
            "ci95": [low, high],
            "goal": f">= {GOAL}",
            "verdict": judged,
        },
    )


if __name__ == "__main__":
    main()
