"""Weight sync: every transport side by side against a raw safetensors round trip, then its share of a training step.

Arms, each a new version pushed to the real service (--replicas engine replicas; a push returns once every replica
serves it), and before each one the weights take a step like an optimizer's at the demo's learning rate (--lr: every
element moves by lr * sign(noise), as Adam's first steps do), so bucketed and delta pushes see real changes:
  raw       safetensors.torch.save of the state dict, load, and copy of every tensor into a second model's
            parameters, in this process, with the torch threads of one replica
  full      rollout_farm/services/weights/pusher.py WeightPusher "full": buckets (--bucket-mib) streamed from the
  tensors' memory
            with per-tensor xxh3 checksums; the ingress puts each bucket in the object store once, and the replicas
            view and check each one in place while the next streams
  bucketed  only the tensors whose checksum changed (at any lr > 0 every trained tensor changes)
  delta     changed tensors as XOR against the last push, byte planes zlib-compressed
  bytes     the old client path: FarmClient.push_weights(safetensors.torch.save(state)) (one bucket, SHA-256)
  path      safetensors save_file into a folder + POST /v1/weights/path (no upload)
The arms run in a rotated order each round (--rounds); per arm the median time and range, and per round its time
over raw's: the median ratio and range. Goal: full <= 1.5x raw for a model of >= 100 MB.

--train-steps N then runs `farm train` for N steps per mode (--train-modes) against the same service, with the
demo's settings (rollout_farm/trainer/demo.py), and reads each step's time (metrics.jsonl, step_seconds: rollouts,
training and the push) and each push's seconds and bytes (FARM_WEIGHT_SYNC_STATS): the sync's share of the step and the
bytes sent per step at the demo's learning rate. --http-proxy haproxy runs all of it behind Ray Serve's HAProxy ingress
(FARM_HTTP_PROXY), --front fused with the engine replicas as their own ingress (FARM_FRONT). Results:
docs/data/weight_sync.json, one entry per --model (and proxy, and front).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from common import DATA, TOKEN, add_front_args, log, resolve, start_service, stop_service, table, wait_quiet, write_json

ARMS = ("raw", "full", "bucketed", "delta", "bytes", "path")


def spread(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="arith-tiny", help="arith-tiny, smollm2 or an HF model folder")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--lr", type=float, default=2e-5, help="the step before each push (the demo's lr)")
    ap.add_argument("--bucket-mib", type=float, default=0, help="WeightPusher's bucket size (0: its default)")
    ap.add_argument("--train-steps", type=int, default=0, help="farm train steps per mode for the step-time share")
    ap.add_argument("--train-modes", default="full,bucketed,delta")
    ap.add_argument("--train-args", default="", help="more farm train overrides, space-separated")
    add_front_args(ap)
    args = ap.parse_args()

    import torch
    from safetensors.torch import load, save, save_file
    from transformers import AutoModelForCausalLM

    from rollout_farm.services.client import FarmClient
    from rollout_farm.services.weights.buckets import BUCKET_BYTES
    from rollout_farm.services.weights.pusher import WeightPusher
    from rollout_farm.services.weights.state_dict import canonical_state_dict

    arms = args.arms.split(",")
    path = resolve(args.model)
    threads = max(1, (os.cpu_count() or 1) // args.replicas)
    torch.set_num_threads(threads)  # what one replica gets
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    target = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()  # raw's "replica"
    state, into = canonical_state_dict(model), canonical_state_dict(target)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    folders = tempfile.mkdtemp(prefix="weight-sync-")
    url = start_service(
        model=str(path), replicas=args.replicas, engine_threads=threads, http_proxy=args.http_proxy, front=args.front
    )
    gen = torch.Generator().manual_seed(0)
    times: dict[str, list[float]] = {a: [] for a in arms}
    sent: dict[str, list[int]] = {a: [] for a in arms}
    ratios: dict[str, list[float]] = {a: [] for a in arms if a != "raw"}
    train: dict = {}
    modes: dict[str, list[str]] = {a: [] for a in arms}  # how each push went (a bucketed push of everything: full)
    try:
        with FarmClient(url, TOKEN, timeout=1800) as client:
            bucket = int(args.bucket_mib * 2**20) or BUCKET_BYTES
            pusher = WeightPusher(client, "full", bucket_bytes=bucket, keep_copy=True)
            version = client.weights_version().version

            def step() -> None:
                with torch.no_grad():
                    for t in state.values():
                        t.sub_(args.lr * torch.sign(torch.randn(t.shape, generator=gen)))

            def run(arm: str) -> tuple[float, int]:
                nonlocal version
                if arm == "raw":
                    t = time.perf_counter()
                    loaded = load(save(state))
                    with torch.no_grad():
                        for name, tensor in loaded.items():
                            into[name].copy_(tensor)
                    return time.perf_counter() - t, 0
                version += 1
                t = time.perf_counter()
                if arm in ("full", "bucketed", "delta"):
                    pusher.mode = arm
                    r = pusher.push(state, version)
                    assert not pusher.last["fallback"], pusher.last  # sent as asked (or in full: all changed)
                    modes[arm].append(pusher.last["mode"])
                elif arm == "bytes":
                    r = client.push_weights(save(state), version)
                else:
                    folder = os.path.join(folders, str(version))
                    os.makedirs(folder)
                    save_file(state, os.path.join(folder, "model.safetensors"))
                    r = client.push_weights_path(folder, version)
                seconds = time.perf_counter() - t
                assert r.version == version
                if arm in ("bytes", "path"):
                    pusher.remember(state, version)  # what the replicas serve now, for the next base push
                    shutil.rmtree(os.path.join(folders, str(version - 3)), ignore_errors=True)
                return seconds, r.bytes

            log(f"{len(state)} tensors, {nbytes / 2**20:.1f} MiB; warm-up")
            for arm in ["full", *arms]:
                step()
                run(arm)
            for i in range(args.rounds):
                wait_quiet(0.25, 120)
                order = arms[i % len(arms) :] + arms[: i % len(arms)]
                got = {}
                for arm in order:
                    step()
                    got[arm] = run(arm)
                    times[arm].append(got[arm][0])
                    sent[arm].append(got[arm][1])
                for arm in ratios:
                    ratios[arm].append(got[arm][0] / got["raw"][0])
                log(f"round {i + 1}/{args.rounds}: " + ", ".join(f"{a} {got[a][0]:.3f}s" for a in arms))
            report(args, path, len(state), nbytes, arms, times, sent, ratios, train, modes)
            for mode in args.train_modes.split(",") if args.train_steps else []:
                train[mode] = train_steps(url, path, mode, args)
                report(args, path, len(state), nbytes, arms, times, sent, ratios, train, modes)
    finally:
        stop_service()
        shutil.rmtree(folders, ignore_errors=True)


def report(args, path, n_tensors: int, nbytes: int, arms, times, sent, ratios, train, modes) -> None:
    rows = [
        [a, spread(times[a])["median"], spread(times[a])["min"], spread(times[a])["max"], *ratio_cells(ratios.get(a))]
        + [statistics.median(sent[a]) / 2**20 if a != "raw" else nbytes / 2**20]
        for a in arms
    ]
    mib = nbytes / 2**20
    print(
        f"weight sync: {args.model} ({n_tensors} tensors, {mib:.1f} MiB float32), {args.replicas} replicas, "
        f"FARM_HTTP_PROXY={args.http_proxy} FARM_FRONT={args.front}"
    )
    print(table(["arm", "median s", "min s", "max s", "/raw median", "/raw min", "/raw max", "MiB sent"], rows))
    for mode, t in train.items():
        print(
            f"farm train, {mode}: step {t['step_s']['median']:.2f}s, push {t['push_s']['median']:.3f}s = "
            f"{t['share']['median']:.1%} of the step; {t['bytes_per_step']['median'] / 2**20:.2f} MiB per step"
        )
    result = {
        "model": args.model,
        "model_path": str(path),
        "args": vars(args),
        "tensors": n_tensors,
        "bytes": nbytes,
        "arms": {
            a: {"seconds": spread(times[a]), "ratio_to_raw": spread(ratios[a]) if a in ratios else None}
            | {"bytes_sent": statistics.median(sent[a]) if a != "raw" else None, "sent_as": modes[a][-args.rounds :]}
            for a in arms
        },
        "train": train,
    }
    merged = json.loads((DATA / "weight_sync.json").read_text()) if (DATA / "weight_sync.json").exists() else {}
    # results under the model's name, '@haproxy' and '@fused' joined for a front other than the split one's defaults
    key = args.model + ("" if args.http_proxy == "serve" else f"@{args.http_proxy}")
    key += "" if args.front == "split" else f"@{args.front}"
    write_json("weight_sync", {"models": {**merged.get("models", {}), key: result}})


def ratio_cells(xs: list[float] | None) -> list:
    return ["-", "-", "-"] if not xs else [statistics.median(xs), min(xs), max(xs)]


def train_steps(url: str, path, mode: str, args, overrides: list[str] | None = None) -> dict:
    """args.train_steps steps of `farm train` with trainer.weight_sync=mode (or `overrides` instead: e.g.
    bench/push_transport.py's trainer.push_dir); each step's time and its push."""
    from rollout_farm.trainer.demo import DEMO_SETTINGS

    out = tempfile.mkdtemp(prefix=f"weight-sync-train-{mode}-")
    stats = os.path.join(out, "pushes.jsonl")
    env = {**os.environ, "FARM_API_TOKEN": TOKEN, "FARM_WEIGHT_SYNC_STATS": stats}
    cmd = [sys.executable, "-m", "rollout_farm.trainer.cli", "train", "--service-url", url, "--model", str(path)]
    cmd += ["--steps", str(args.train_steps), "--eval-size", "0", "--out", out, "trainer.resume_mode=disable"]
    cmd += [f"trainer.weight_sync={mode}"] if overrides is None else overrides
    cmd += [*DEMO_SETTINGS, *args.train_args.split()]
    log(f"farm train, {args.train_steps} steps, {mode}")
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
    steps = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl")) if '"train_step"' in x]
    pushes = [json.loads(x) for x in open(stats)][-len(steps) :]  # the first line is the start's push
    shutil.rmtree(out, ignore_errors=True)
    step_s = [s["step_seconds"] for s in steps]
    return {
        "steps": len(steps),
        "step_s": spread(step_s),
        "push_s": spread([p["seconds"] for p in pushes]),
        "share": spread([p["seconds"] / s for p, s in zip(pushes, step_s)]),
        "bytes_per_step": spread([p["bytes"] for p in pushes]),
        "step_seconds": step_s,
        "push_seconds": [p["seconds"] for p in pushes],
        "sent_as": [p["mode"] for p in pushes],
        "settings": [*DEMO_SETTINGS, *args.train_args.split()],
    }


if __name__ == "__main__":
    main()
