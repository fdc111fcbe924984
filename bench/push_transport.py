"""The trainer's two weight transports side by side: an HTTP upload against a push by path, in `farm train`.

Both arms run `farm train` (bench/weight_sync.py's train_steps: the demo's settings, each step's time from
metrics.jsonl, each push's seconds and bytes from FARM_WEIGHT_SYNC_STATS) against the same service, one arm after the
other in a rotated order each round (--rounds, --train-steps steps per arm and round):
  upload  trainer.weight_sync=full (the default): the state dict streamed over HTTP (POST /v1/weights); the farm
          also writes it to FARM_UPLOADS_DIR before the commit (`farm serve`'s default with its embedded Redis, so
          that a restarted farm serves it)
  path    trainer.push_dir=<a folder the farm reads>: written once as v<N>/model.safetensors, then
          POST /v1/weights/path; each replica reads the folder itself
Per arm: seconds per push (write and call, until every replica serves it) and its share of the step. Paired: the
k-th push of each arm in a round (the same round, so the same load on the machine) gives one ratio upload / path; their
geometric mean with a 95% t interval, and the verdict on "by path is faster" (holds when the interval is above 1). The
service
runs with its own defaults (FARM_FRONT fused, FARM_HTTP_PROXY haproxy) and --replicas engine replicas. Results:
docs/data/push_transport.json.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile

from common import interval, log, resolve, start_service, stop_service, table, verdict, write_json
from weight_sync import spread, train_steps

ARMS = ("upload", "path")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="arith-tiny, smollm2 or an HF model folder")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--train-steps", type=int, default=2, help="farm train steps per arm and round")
    ap.add_argument("--train-args", default="data.train_batch_size=4", help="more farm train overrides")
    ap.add_argument("--front", default="fused", choices=["split", "fused"], help="FARM_FRONT (the service's default)")
    ap.add_argument("--http-proxy", default="haproxy", choices=["serve", "haproxy"], help="FARM_HTTP_PROXY (default)")
    args = ap.parse_args()

    path = resolve(args.model)
    url = start_service(
        model=str(path), replicas=args.replicas, engine_threads=1, front=args.front, http_proxy=args.http_proxy
    )
    steps_dir = tempfile.mkdtemp(prefix="push-transport-steps-")  # removed with the service, in the finally
    overrides = {"upload": ["trainer.weight_sync=full"], "path": [f"trainer.push_dir={steps_dir}"]}
    runs: dict[str, list[dict]] = {a: [] for a in ARMS}
    try:
        for i in range(args.rounds):
            for arm in ARMS[i % 2 :] + ARMS[: i % 2]:
                runs[arm].append(train_steps(url, path, arm, args, overrides[arm]))
                log(f"round {i + 1}/{args.rounds}, {arm}: push {runs[arm][-1]['push_s']['median']:.2f}s")
    finally:
        stop_service()
        shutil.rmtree(steps_dir, ignore_errors=True)  # every step's weights: up to 1.6 GB of SmolLM2 checkpoints
    report(args, path, runs)


def report(args, path, runs: dict[str, list[dict]]) -> None:
    arms = {}
    for arm, done in runs.items():
        pushes = [s for r in done for s in r["push_seconds"]]
        steps = [s for r in done for s in r["step_seconds"]]
        arms[arm] = {
            "push_s": spread(pushes),
            "step_s": spread(steps),
            "share": spread([p / s for p, s in zip(pushes, steps)]),
            "bytes_per_push": statistics.median([r["bytes_per_step"]["median"] for r in done]),
            "steps": len(steps),
            "sent_as": [m for r in done for m in r["sent_as"]],
        }
    rows = [
        [a, v["push_s"]["median"], v["push_s"]["min"], v["push_s"]["max"], v["step_s"]["median"], v["share"]["median"]]
        for a, v in arms.items()
    ]
    print(f"weight push transports in farm train: {args.model}, {args.replicas} replicas, {args.train_args}")
    print(table(["arm", "push median s", "min s", "max s", "step median s", "push / step"], rows))
    ratio = arms["path"]["push_s"]["median"] / arms["upload"]["push_s"]["median"]
    pairs = [  # the k-th push of each arm in the same round
        u / p for up, pa in zip(runs["upload"], runs["path"]) for u, p in zip(up["push_seconds"], pa["push_seconds"])
    ]
    mean, low, high = interval(pairs)
    faster = {"upload_over_path": mean, "ci95": [low, high], "pairs": len(pairs), "verdict": verdict(low, high, 1.0)}
    print(f"path / upload, median push: {ratio:.2f}")
    print(
        f"upload / path, paired by round: {mean:.2f} (95% CI {low:.2f}-{high:.2f}, {len(pairs)} pairs): by path faster "
        f"{faster['verdict']}"
    )
    write_json(
        "push_transport",
        {
            "model": args.model,
            "model_path": str(path),
            "args": vars(args),
            "arms": arms,
            "path_over_upload": ratio,
            "path_faster": faster,
        },
    )


if __name__ == "__main__":
    main()
