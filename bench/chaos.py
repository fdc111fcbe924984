"""Chaos: a queue-mode training run while engine replicas, ingress replicas and the trainer are killed at random
moments, against the same run with no faults.

The real service starts here (2 engine replicas, 2 ingress replicas, the embedded redis-server). Each run is
`farm train` as a subprocess in queue mode (trainer.rollout_source=queue), a checkpoint every step
(trainer.save_freq=1, so a killed trainer resumes from its last step), its own queue source. The clean run goes
first; its wall time sets the window of the chaos run's faults: --faults kills of each kind at moments drawn
uniformly from it (seeded), in random order:
  engine    ray.kill of a random engine replica (Serve starts another; it loads the committed version)
  ingress   ray.kill of a random ingress replica (the queue lives in Redis; another replica takes its sources)
  trainer   SIGKILL of the trainer; it is started again at once with the same command, and resumes
Recovery time: engine and ingress, until Serve runs the full count of replicas of that deployment again and
GET /readyz answers 200; trainer, until the restarted trainer finishes its next step.

Lost and duplicated are read from the queue's own records in Redis after each run: every prompt instance
(pid) the trainer fed must be acked exactly once (its `settled` count is 1), or still be waiting in the queue
(pending, being generated, or a generated group not yet acked). Lost: a pid in none of these; duplicated: a pid
acked more than once, or acked and still in the queue. Both must be 0.
Throughput: groups trained per second of wall time, chaos ÷ clean. A trainer that exits with an error (a call the
faults made fail) is started again, as an orchestrator would; those crashes are counted and reported.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
from common import RESULTS, TOKEN, log, resolve, start_service, stop_service, table, write_json

KINDS = ("engine", "ingress", "trainer")
REPLICAS = 2  # engine replicas, and ingress replicas


def trainer_cmd(url: str, model: Path, out: Path, source: str, args) -> list[str]:
    return [
        sys.executable,
        "-m",
        "rollout_farm.trainer.cli",
        "train",
        "--service-url",
        url,
        "--model",
        str(model),
        "--steps",
        str(args.steps),
        "--train-batch-size",
        str(args.batch),
        "--n",
        str(args.n),
        "--eval-size",
        "0",
        "--out",
        str(out),
        "trainer.rollout_source=queue",
        f"trainer.queue_source={source}",
        "trainer.save_freq=1",
        f"trainer.queue_lease_s={args.lease_s}",
        f"trainer.seed={args.seed}",
    ]


def steps_done(out: Path) -> int:
    path = out / "metrics.jsonl"
    return len({json.loads(line)["step"] for line in path.read_text().splitlines()}) if path.exists() else 0


def actors(prefix: str) -> dict[str, str]:
    """Serve replicas whose actor name starts with `prefix`: name -> namespace."""
    import ray

    return {
        a["name"]: a["namespace"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith(prefix)
    }


def crash_reason(out: Path) -> str:
    lines = (out.parent / f"{out.name}.trainer.log").read_text().splitlines()
    errors = [line for line in lines if "Error" in line and not line.startswith(" ")]
    return errors[-1][:300] if errors else "no error line"


def ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/readyz", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


class Run:
    """One training run; in chaos mode, the faults are carried out at their moments from the start."""

    def __init__(self, url: str, model: Path, name: str, args, faults: list[tuple[float, str]]):
        self.url, self.args, self.faults = url, args, faults
        self.out = RESULTS / "chaos" / name
        subprocess.run(["rm", "-rf", str(self.out), f"{self.out}.trainer.log"], check=True)
        self.cmd = trainer_cmd(url, model, self.out, name, args)
        self.env = {**os.environ, "FARM_API_TOKEN": TOKEN}
        self.recoveries: list[dict] = []
        self.crashes: list[str] = []  # the trainer's own exits (not our kills), each with its last error line
        self.lock = threading.Lock()

    def start_trainer(self) -> subprocess.Popen:
        log_file = (self.out.parent / f"{self.out.name}.trainer.log").open("a")
        return subprocess.Popen(self.cmd, env=self.env, stdout=log_file, stderr=subprocess.STDOUT)

    def go(self) -> float:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        start = time.monotonic()
        self.proc = self.start_trainer()
        pending = sorted(self.faults)
        while True:
            code = self.proc.poll()
            if code == 0:
                break
            if code is not None:  # a crash the faults caused: restarted, as an orchestrator would, and counted
                self.crashes.append(crash_reason(self.out))
                log(f"trainer crashed ({self.crashes[-1]}); restarting it")
                if len(self.crashes) > 5:
                    raise RuntimeError(f"the trainer keeps crashing: see {self.out}.trainer.log")
                self.proc = self.start_trainer()
            if pending and time.monotonic() - start >= pending[0][0]:
                self.fault(pending.pop(0)[1])
            time.sleep(0.1)
        seconds = time.monotonic() - start  # the training run's; the recoveries still being watched are not in it
        for t in [t for t in threading.enumerate() if t.name == "recovery"]:
            t.join(timeout=300)
        if pending:
            log(f"run ended before {len(pending)} faults: {[k for _, k in pending]}")
        return seconds

    def fault(self, kind: str) -> None:
        t0 = time.monotonic()
        if kind == "trainer":
            before = steps_done(self.out)
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
            self.proc = self.start_trainer()
            watch = lambda: steps_done(self.out) > before or self.proc.poll() is not None  # noqa: E731
        else:
            import ray

            replicas = actors(f"SERVE_REPLICA::farm#{kind}")
            victim = random.Random(t0).choice(sorted(replicas))
            ray.kill(ray.get_actor(victim, namespace=replicas[victim]), no_restart=True)
            prefix = f"SERVE_REPLICA::farm#{kind}"

            def watch():  # the dead replica's name is gone, the full count is back, and /readyz says all serve
                now = actors(prefix)
                return victim not in now and len(now) == REPLICAS and ready(self.url)

        log(f"fault: {kind} killed")

        def wait():
            while not watch():
                time.sleep(0.2)
            with self.lock:
                self.recoveries.append({"kind": kind, "seconds": round(time.monotonic() - t0, 2)})
            log(f"recovered from {kind} in {time.monotonic() - t0:.1f}s")

        threading.Thread(target=wait, name="recovery", daemon=True).start()


def audit(redis_url: str, source: str) -> dict:
    """Each pid fed to the source: acked once, or still in the queue (see the module docstring)."""
    import redis

    from rollout_farm.services.queue.store import GROUP, Keys
    from rollout_farm.services.state.redis_client import prefix

    r = redis.Redis.from_url(redis_url, decode_responses=True)
    k = Keys(prefix("farm"), source)
    fed = int(r.hget(k.stats, "pids") or 0)
    settled = {int(p): int(c) for p, c in r.hgetall(k.settled).items()}
    waiting = [json.loads(e)["pid"] for e in r.lrange(k.pending, 0, -1) + r.lrange(k.generating, 0, -1)]
    waiting += [json.loads(f["entry"])["pid"] for _, f in r.xrange(k.ready)]
    in_pel = r.xpending(k.ready, GROUP)["pending"]
    lost = [p for p in range(1, fed + 1) if p not in settled and p not in waiting]
    duplicated = [p for p, c in settled.items() if c > 1] + [p for p in waiting if p in settled]
    duplicated += [p for p in set(waiting) if waiting.count(p) > 1]
    return {
        "prompts_fed": fed,
        "acked": sum(settled.values()),
        "waiting": len(waiting),
        "leased_unacked": in_pel,
        "lost": len(lost),
        "duplicated": len(duplicated),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="arith-tiny", help="arith-tiny, smollm2 or an HF model folder")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch", type=int, default=8, help="prompts (groups) per step")
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--faults", type=int, default=2, help="kills of each kind")
    ap.add_argument("--lease-s", type=float, default=20.0, help="the trainer's queue lease")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    from rollout_farm.services.serving import server

    model = resolve(args.model)
    url = start_service(
        model=str(model),
        replicas=REPLICAS,
        front="split",  # it kills ingress replicas, a deployment of their own only with the split front
        ingress_replicas=REPLICAS,
        engine_threads=1,
        log_level="WARNING",
    )
    try:
        redis_url = server.EMBEDDED[-1].url
        log("clean run")
        clean = Run(url, model, f"clean-{args.seed}", args, [])
        clean_s = clean.go()
        clean_audit = audit(redis_url, clean.out.name)
        rng = random.Random(args.seed)
        faults = [(rng.uniform(0.1, 0.9) * clean_s, kind) for kind in KINDS for _ in range(args.faults)]
        log(f"chaos run: {len(faults)} faults at {[f'{t:.0f}s {k}' for t, k in sorted(faults)]}")
        chaos = Run(url, model, f"chaos-{args.seed}", args, faults)
        chaos_s = chaos.go()
        chaos_audit = audit(redis_url, chaos.out.name)
    finally:
        stop_service()
    groups = args.steps * args.batch
    ratio = (groups / chaos_s) / (groups / clean_s)
    by_kind = {
        kind: [r["seconds"] for r in chaos.recoveries if r["kind"] == kind] for kind in KINDS
    }  # every recovery, in seconds
    rows = [
        ["clean", f"{clean_s:.0f}", clean_audit["lost"], clean_audit["duplicated"], f"{groups / clean_s:.2f}", "-"],
        ["chaos", f"{chaos_s:.0f}", chaos_audit["lost"], chaos_audit["duplicated"], f"{groups / chaos_s:.2f}", ratio],
    ]
    print(table(["run", "seconds", "lost", "duplicated", "groups/s", "throughput ratio"], rows))
    for kind, secs in by_kind.items():
        print(f"recovery after {kind} kills: {secs} s")
    print(f"trainer crashes caused by the faults (restarted): {len(chaos.crashes)} {chaos.crashes}")
    write_json(
        "chaos",
        {
            "args": vars(args),
            "clean": {"seconds": clean_s, **clean_audit},
            "chaos": {
                "seconds": chaos_s,
                **chaos_audit,
                "faults": sorted(faults),
                "recoveries": chaos.recoveries,
                "trainer_crashes": chaos.crashes,
            },
            "throughput_ratio": ratio,
        },
    )


if __name__ == "__main__":
    main()
