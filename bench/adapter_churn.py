"""Adapter churn at full size (issue 37): tenants push new LoRA adapter versions while thousands of rollouts name
them, on two engine replicas, one of which is killed once.

The real service (arith-tiny, the torch engine, --replicas engine replicas with one torch thread each) and
--tenants tenants made with the admin token. Every tenant pushes versions 1..--pushes of its own adapter with its
own token (an upload, as peft_files.upload_body makes it). The bytes differ for every (tenant, version): six peft
adapters (rank 4 on q_proj, v_proj, down_proj, B drawn at random, seeds 1-6) are cycled, and one tensor of each is
scaled by a factor unique to the (tenant, version), so no two versions share a digest. The pushes are paced by the
traffic: version v is pushed once (v - 1) / pushes of --requests rollouts have started (or at once, when the pushes
are the slower side). Meanwhile --concurrency async clients (httpx), spread over the tenants, post one-prompt
rollouts (n = --n, --new-tokens tokens, temperature 1) naming {name, version} of their tenant's newest committed
version, or the one or two before it (all inside the resident window, FARM_ADAPTER_VERSIONS_RESIDENT = 3, when
sent), until every push is done and at least --requests rollouts have started. When half of all pushes are
committed, one engine replica is killed (ray.kill with no_restart, as bench/chaos.py does); Serve starts another,
which loads each resident version it lacks from Redis (and checks its digest) before it samples from it.

The client does what a trainer's does: a 429 (queues full) and a 503 with Retry-After (a replica died under the
call) are sent again after the Retry-After, up to --retries times; a push that fails is sent again (same version,
same bytes). Each tenant's last --after-recovery-pushes versions wait until the replacement replica serves, so
that it takes pushes and traffic too (it loads a resident version it lacks from Redis). Every attempt's status is
recorded, so the table shows what a client without retries would have seen.

Checked for every answer:
  wrong-digest samples  a sample whose policy (adapter, adapter_version, digest) is not the named version's, as
                        its push answer gave it (that digest is also computed here from the pushed bytes and the
                        base's, as a trainer does, and must agree); target 0
  in-window refusals    a 409 for a version still inside the window when it was answered (newest committed minus
                        the version < 3, and no push that would evict it in flight); target 0. A 409 for a version
                        that had left the window by then is correct and counted apart; one that met a push of the
                        evicting version in flight (committed on the service, not yet answered to the pusher) is
                        counted apart too (a race the client cannot order); a 409 for any other reason (a
                        digest mismatch on a replica) fails the check
  backstop 503s         a 503 of the ingress's policy check (a sample of another policy reached it, and nothing
                        was delivered): retried like any 503, but counted as a failure; target 0
  other statuses        counted by status and reason, first attempts and final answers

    .venv/bin/python bench/adapter_churn.py              # full size, about 3-4 min on 2 cores (1-2 min to start)
    .venv/bin/python bench/adapter_churn.py --tenants 2 --pushes 10 --after-recovery-pushes 3 --requests 300 \
        --concurrency 16                                 # a smoke, about 1.5 min
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

from common import TOKEN, log, provenance, resolve, start_service, stop_service, table, write_json

RESIDENT = 3  # FARM_ADAPTER_VERSIONS_RESIDENT's default: the service is started with it
TARGETS = ("q_proj", "v_proj", "down_proj")
BASES = 6  # peft adapters made once; every (tenant, version) scales one tensor of one of them
PROMPTS = ["12 + 7 =", "3 * 4 =", "40 - 15 =", "9 + 9 =", "6 * 7 =", "81 - 27 ="]


def make_adapters(base: Path, out: Path) -> list[tuple[str, dict]]:
    """BASES peft adapter folders on the model at `base`: (adapter_config.json text, tensors) for each."""
    import torch
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    made = []
    for seed in range(1, BASES + 1):
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8.0, target_modules=list(TARGETS)))
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in peft_model.named_parameters():
                if "lora_" in name:  # peft starts B at zero: drawn at random, each adapter is a policy of its own
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        folder = out / f"a{seed}"
        peft_model.save_pretrained(folder)
        made.append(((folder / "adapter_config.json").read_text(), load_file(folder / "adapter_model.safetensors")))
    return made


def variant(made: list[tuple[str, dict]], ti: int, version: int, pushes: int, base_digest: str) -> dict:
    """The upload body of tenant ti's `version` (bytes unique to the pair) and the digest a trainer expects for it."""
    from safetensors.torch import save

    from rollout_farm.services.adapters.digest import adapter_digest, tensor_checksums
    from rollout_farm.services.adapters.peft_format import read_config
    from rollout_farm.services.client.peft_files import CONFIG_META

    config, tensors = made[(version + 2 * ti) % BASES]
    tensors = dict(tensors)
    key = sorted(k for k in tensors if "lora_B" in k)[0]
    tensors[key] = (tensors[key] * (1.0 + 1e-3 * (ti * pushes + version))).contiguous()
    body = save(tensors, metadata={"format": "pt", CONFIG_META: config})  # what peft_files.upload_body sends
    expected = adapter_digest(base_digest, read_config(config).canonical(), *tensor_checksums(tensors))
    return {"body": body, "expected": expected}


def engine_replicas() -> dict[str, str]:
    """The engine's Serve replicas: actor name -> namespace."""
    import ray

    prefix = "SERVE_REPLICA::farm#engine"
    return {
        a["name"]: a["namespace"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith(prefix)
    }


class Churn:
    def __init__(self, url: str, args, tokens: dict[str, str], bodies: dict[tuple[str, int], dict]):
        self.url, self.args, self.bodies = url, args, bodies
        self.tenants = list(tokens)
        self.headers = {t: {"Authorization": f"Bearer {tok}"} for t, tok in tokens.items()}
        self.committed = {t: 0 for t in self.tenants}  # newest version whose push was answered 200
        self.pushing: dict[str, int | None] = {t: None for t in self.tenants}  # version being pushed now
        self.digests: dict[tuple[str, int], str] = {}
        self.pushes_done = 0
        self.push_log: list[dict] = []
        self.push_failures: list[dict] = []
        self.started = 0  # rollouts started
        self.in_flight = self.peak = 0
        self.records: list[dict] = []
        self.kill: dict = {}
        self.t0 = time.monotonic()
        self.rng = random.Random(args.seed)

    def now(self) -> float:
        return round(time.monotonic() - self.t0, 3)

    def pushes_over(self) -> bool:
        return all(v == self.args.pushes for v in self.committed.values())

    async def pusher(self, http, t: str) -> None:
        per_push = self.args.requests / self.args.pushes
        for v in range(1, self.args.pushes + 1):
            while self.started < (v - 1) * per_push:  # paced by the traffic, so the pushes span the rollouts
                await asyncio.sleep(0.05)
            if self.args.kill and v > self.args.pushes - self.args.after_recovery_pushes:
                while "recovered_s" not in self.kill:  # the last versions go to the replacement replica too
                    await asyncio.sleep(0.05)
            self.pushing[t] = v
            for attempt in range(1, self.args.retries + 1):
                sent = self.now()
                try:
                    r = await http.post(
                        f"/v1/adapters/{t}",
                        params={"version": v},
                        content=self.bodies[(t, v)]["body"],
                        headers=self.headers[t],
                        timeout=300,
                    )
                    status, text = r.status_code, r.text
                except Exception as e:  # the connection itself: counted and sent again, as a trainer would
                    status, text = "error", f"{type(e).__name__}: {e}"
                if status == 200:
                    break
                self.push_failures.append(
                    {"tenant": t, "version": v, "attempt": attempt, "at_s": sent, "status": status, "body": text[:400]}
                )
                log(f"push {t}@v{v} attempt {attempt}: {status} {text[:200]}")
                await asyncio.sleep(1.0)
            else:
                raise RuntimeError(f"push {t}@v{v} failed {self.args.retries} times: {status} {text[:300]}")
            answer = r.json()
            self.digests[(t, v)] = answer["digest"]
            self.committed[t], self.pushing[t] = v, None
            self.pushes_done += 1
            self.push_log.append(
                {
                    "tenant": t,
                    "version": v,
                    "at_s": self.now(),
                    "seconds": answer["seconds"],
                    "evicted": answer.get("evicted", []),
                    "again": answer.get("again", False),
                    "digest_as_computed_here": answer["digest"] == self.bodies[(t, v)]["expected"],
                }
            )
            if v % 10 == 0:
                log(f"{t}: v{v} committed ({self.started} rollouts started, {self.in_flight} in flight)")

    async def sampler(self, http, worker: int) -> None:
        t = self.tenants[worker % len(self.tenants)]
        rng = random.Random(self.args.seed * 1000 + worker)
        while not (self.pushes_over() and self.started >= self.args.requests):
            newest = self.committed[t]
            if newest == 0:
                await asyncio.sleep(0.05)
                continue
            v = max(1, newest - rng.choice((0, 0, 1, 2)))  # the newest, or one of the two before it
            self.started += 1
            body = {
                "prompts": [{"text": rng.choice(PROMPTS)}],
                "n": self.args.n,
                "adapter": {"name": t, "version": v},
                "sampling_params": {"temperature": 1.0, "max_new_tokens": self.args.new_tokens, "ignore_eos": True},
            }
            rec = {"tenant": t, "version": v, "newest_at_send": newest, "sent_s": self.now(), "attempts": []}
            self.in_flight += 1
            self.peak = max(self.peak, self.in_flight)
            try:
                for _ in range(self.args.retries):
                    try:
                        r = await http.post("/v1/rollouts", json=body, headers=self.headers[t])
                        status, text, wait = r.status_code, r.text, float(r.headers.get("retry-after", 1))
                    except Exception as e:
                        status, text, wait = "error", f"{type(e).__name__}: {e}", 1.0
                    rec["attempts"].append([self.now(), status])
                    if status == 503 and "came with policy" in text:  # the ingress caught another policy's sample
                        rec["backstop"] = rec.get("backstop", 0) + 1
                        log(f"POLICY BACKSTOP 503: {t}@v{v}: {text[:300]}")
                    if status in (429, 503, "error") and not (status == 429 and "tenant" in text):
                        rec.setdefault("retried_bodies", []).append(text[:300])
                        await asyncio.sleep(wait)
                        continue
                    break
            finally:
                self.in_flight -= 1
            rec.update(
                status=status,
                answered_s=self.now(),
                newest_at_answer=self.committed[t],
                pushing_at_answer=self.pushing[t],
            )
            self.check(rec, status, text)
            self.records.append(rec)

    def check(self, rec: dict, status, text: str) -> None:
        t, v = rec["tenant"], rec["version"]
        if status == 200:
            wrong = []
            samples = 0
            for g in json.loads(text)["groups"]:
                for s in g["samples"]:
                    samples += 1
                    p = s["policy"]
                    if (p.get("adapter"), p.get("adapter_version"), p.get("digest")) != (t, v, self.digests[(t, v)]):
                        wrong.append(p)
            rec["samples"], rec["wrong"] = samples, wrong
            if wrong:
                log(f"WRONG POLICY: {t}@v{v} answered with {wrong[:2]}")
        elif status == 409:
            rec["body"] = text[:400]
            if "left the resident window" not in text:  # a refusal for another reason than the window
                rec["refusal"] = "other"
                log(f"409 for another reason: {t}@v{v}: {text[:300]}")
            elif rec["newest_at_answer"] - v >= RESIDENT:
                rec["refusal"] = "out_of_window"
            elif rec["pushing_at_answer"] is not None and rec["pushing_at_answer"] - v >= RESIDENT:
                rec["refusal"] = "evicting_push_in_flight"
            else:
                rec["refusal"] = "in_window"
                log(f"IN-WINDOW REFUSAL: {t}@v{v} (newest {rec['newest_at_answer']}): {text[:300]}")
        else:
            rec["body"] = text[:400]
            log(f"rollout {t}@v{v}: {status} {text[:200]}")

    async def killer(self) -> None:
        """Once half of all pushes are committed: ray.kill one engine replica; then wait for Serve's replacement."""
        import httpx
        import ray

        half = len(self.tenants) * self.args.pushes // 2
        while self.pushes_done < half:
            await asyncio.sleep(0.05)
        before = await asyncio.to_thread(engine_replicas)
        victim = random.Random(self.args.seed).choice(sorted(before))
        at = self.now()
        await asyncio.to_thread(lambda: ray.kill(ray.get_actor(victim, namespace=before[victim]), no_restart=True))
        self.kill = {"at_s": at, "victim": victim, "pushes_done": self.pushes_done, "rollouts_started": self.started}
        log(f"killed engine replica {victim} at {at:.1f}s ({self.pushes_done} pushes, {self.started} rollouts)")
        async with httpx.AsyncClient(base_url=self.url, timeout=10) as http:
            while True:
                now = await asyncio.to_thread(engine_replicas)
                if victim not in now and len(now) == len(before):
                    try:
                        if (await http.get("/readyz")).status_code == 200:
                            break
                    except httpx.HTTPError:
                        pass
                await asyncio.sleep(0.2)
        self.kill["recovered_s"] = self.now()
        self.kill["recovery_s"] = round(self.kill["recovered_s"] - at, 2)
        log(f"a new engine replica serves: recovered in {self.kill['recovery_s']:.1f}s")

    async def run(self) -> None:
        import httpx

        limits = httpx.Limits(max_connections=self.args.concurrency + 2 * len(self.tenants) + 8)
        async with httpx.AsyncClient(base_url=self.url, timeout=300, limits=limits) as http:
            self.t0 = time.monotonic()
            jobs = [self.pusher(http, t) for t in self.tenants]
            jobs += [self.sampler(http, w) for w in range(self.args.concurrency)]
            if self.args.kill:
                jobs.append(self.killer())
            await asyncio.gather(*jobs)
        self.wall = self.now()


def summarize(churn: Churn, args) -> dict:
    recs = churn.records
    ok = [r for r in recs if r["status"] == 200]
    wrong = [r for r in ok if r["wrong"]]
    refusals = collections.Counter(r["refusal"] for r in recs if r["status"] == 409)
    first = collections.Counter(str(r["attempts"][0][1]) for r in recs)
    final = collections.Counter(str(r["status"]) for r in recs)
    retried = collections.Counter(str(s) for r in recs for _, s in r["attempts"][:-1])
    kill_at = churn.kill.get("at_s")
    recovered = churn.kill.get("recovered_s")
    unavailable = [(at, r) for r in recs for at, s in r["attempts"] if s == 503]
    reasons = collections.Counter(
        b.split('"message":')[1][:120] if '"message":' in b else b[:120]
        for r in recs
        for b in r.get("retried_bodies", [])
    )

    def phase(lo: float, hi: float) -> dict:
        inside = [r for r in recs if lo <= r["sent_s"] < hi]
        return {"requests": len(inside), "final_status": dict(collections.Counter(str(r["status"]) for r in inside))}

    latencies = sorted(r["answered_s"] - r["sent_s"] for r in ok)
    per_version_lag = collections.Counter(r["newest_at_send"] - r["version"] for r in recs)
    return {
        "requests": len(recs),
        "samples": sum(r["samples"] for r in ok),
        "peak_in_flight": churn.peak,
        "pushes_done": churn.pushes_done,
        "push_failures": churn.push_failures,
        "push_seconds_median": statistics.median(p["seconds"] for p in churn.push_log) if churn.push_log else None,
        "pushes_committed_while_a_replica_was_down": sum(
            1 for p in churn.push_log if kill_at is not None and kill_at <= p["at_s"] <= (recovered or 1e9)
        ),
        "push_digests_as_computed_here": sum(p["digest_as_computed_here"] for p in churn.push_log),
        "distinct_digests": len(set(churn.digests.values())),
        "wall_s": churn.wall,
        "kill": churn.kill,
        "wrong_digest_samples": sum(len(r["wrong"]) for r in wrong),
        "backstop_503s": sum(r.get("backstop", 0) for r in recs),
        "wrong_digest_requests": [
            {k: r[k] for k in ("tenant", "version", "sent_s", "answered_s", "wrong")} for r in wrong[:10]
        ],
        "refusals": dict(refusals),
        "window_refusals_at": {
            "ingress (version evicted when resolved)": sum(1 for r in recs if "was evicted" in r.get("body", "")),
            "replica (left the window while waiting)": sum(
                1 for r in recs if "while this request" in r.get("body", "")
            ),
        },
        "phases": {
            "before_kill": phase(0, kill_at if kill_at is not None else 1e9),
            "replica_down": phase(kill_at, recovered or 1e9) if kill_at is not None else None,
            "after_recovery": phase(recovered, 1e9) if recovered is not None else None,
        },
        "in_window_refusals": [r for r in recs if r.get("refusal") == "in_window"][:10],
        "out_of_window_examples": [r.get("body") for r in recs if r.get("refusal") == "out_of_window"][:3],
        "first_attempt_status": dict(first),
        "final_status": dict(final),
        "retried_attempts_by_status": dict(retried),
        "retry_reasons": dict(reasons.most_common(10)),
        "unavailable_503_attempts": len(unavailable),
        "unavailable_503_in_kill_window": sum(
            1 for at, _ in unavailable if kill_at and at >= kill_at and at <= (recovered or 1e9) + 5
        ),
        "unavailable_503_first_last_s": [min(a for a, _ in unavailable), max(a for a, _ in unavailable)]
        if unavailable
        else None,
        "other_final": [
            {k: r.get(k) for k in ("tenant", "version", "status", "answered_s", "body")}
            for r in recs
            if r["status"] not in (200, 409)
        ][:20],
        "version_lag_at_send": {str(k): v for k, v in sorted(per_version_lag.items())},
        "latency_s_200": {
            "p50": latencies[len(latencies) // 2] if latencies else None,
            "p99": latencies[int(len(latencies) * 0.99)] if latencies else None,
            "max": latencies[-1] if latencies else None,
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tenants", type=int, default=4)
    ap.add_argument("--pushes", type=int, default=50, help="versions each tenant pushes")
    ap.add_argument("--requests", type=int, default=2000, help="rollouts started at least (more while pushes run)")
    ap.add_argument("--concurrency", type=int, default=64, help="async clients posting rollouts, one at a time each")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--n", type=int, default=2, help="samples per rollout")
    ap.add_argument("--new-tokens", type=int, default=6)
    ap.add_argument("--retries", type=int, default=20, help="attempts per rollout (429, 503) and per push")
    ap.add_argument(
        "--after-recovery-pushes",
        type=int,
        default=10,
        help="each tenant's last versions, pushed only once the replacement replica serves",
    )
    ap.add_argument("--no-kill", dest="kill", action="store_false", help="kill no replica")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.kill and not 0 <= args.after_recovery_pushes <= args.pushes // 2:
        ap.error("--after-recovery-pushes must be at most half of --pushes (the kill comes at half of the pushes)")

    import httpx
    from safetensors.torch import load_file

    from rollout_farm.services.adapters.digest import base_digest, tensor_checksums

    model = resolve("arith-tiny")
    log(f"making {BASES} peft adapters on {model.name}")
    made = make_adapters(model, Path(tempfile.mkdtemp(prefix="adapter-churn-")))
    base = base_digest(*tensor_checksums(load_file(model / "model.safetensors")))
    names = [f"churn-{i}" for i in range(args.tenants)]
    bodies = {
        (t, v): variant(made, ti, v, args.pushes, base) for ti, t in enumerate(names) for v in range(1, args.pushes + 1)
    }
    assert len({b["expected"] for b in bodies.values()}) == len(bodies), "two versions with the same bytes"
    url = start_service(
        model=str(model),
        replicas=args.replicas,
        engine_threads=1,
        log_level="WARNING",
        adapter_versions_resident=RESIDENT,
    )
    try:
        admin = {"Authorization": f"Bearer {TOKEN}"}
        tokens = {t: httpx.post(f"{url}/v1/tenants/{t}", headers=admin).json()["token"] for t in names}
        log(f"{args.tenants} tenants x {args.pushes} pushes, >= {args.requests} rollouts, {args.concurrency} clients")
        churn = Churn(url, args, tokens, bodies)
        asyncio.run(churn.run())
        held = {t: httpx.get(f"{url}/v1/adapters/{t}", headers=admin).json() for t in names}
    finally:
        stop_service()
    s = summarize(churn, args)
    s["adapters_at_end"] = {t: {k: v for k, v in a.items() if k != "versions"} for t, a in held.items()}
    wrong_ok = s["wrong_digest_samples"] == 0
    window_ok = s["refusals"].get("in_window", 0) == 0
    failed_final = sum(v for k, v in s["final_status"].items() if k not in ("200", "409"))
    rows = [
        ["samples with another policy's digest", 0, s["wrong_digest_samples"], "holds" if wrong_ok else "fails"],
        [
            "409 for a version inside the window",
            0,
            s["refusals"].get("in_window", 0),
            "holds" if window_ok else "fails",
        ],
        ["409 for a version that had left it", "-", s["refusals"].get("out_of_window", 0), "(correct)"],
        ["409 while the evicting push was in flight", "-", s["refusals"].get("evicting_push_in_flight", 0), "(race)"],
        [
            "409 for another reason",
            0,
            s["refusals"].get("other", 0),
            "fails" if s["refusals"].get("other") else "holds",
        ],
        [
            "503s of the ingress's policy backstop (retried)",
            0,
            s["backstop_503s"],
            "fails" if s["backstop_503s"] else "holds",
        ],
        [
            "push answers with another digest than computed here",
            0,
            s["pushes_done"] - s["push_digests_as_computed_here"],
            "holds" if s["pushes_done"] == s["push_digests_as_computed_here"] else "fails",
        ],
        ["503 attempts, all reasons (retried after Retry-After)", "-", s["unavailable_503_attempts"], "-"],
        ["rollouts failed after retries", 0, failed_final, "holds" if failed_final == 0 else "fails"],
    ]
    print(
        f"adapter churn: {args.tenants} tenants x {args.pushes} pushes ({s['pushes_done']} done), {s['requests']} "
        f"rollouts ({s['samples']} samples), peak {s['peak_in_flight']} in flight, {args.replicas} replicas, "
        f"kill at {s['kill'].get('at_s')} s (recovered in {s['kill'].get('recovery_s')} s), {s['wall_s']:.0f} s wall"
    )
    print(table(["check", "target", "measured", "verdict"], rows))
    print(f"first attempts by status: {s['first_attempt_status']}; final: {s['final_status']}")
    s["verdicts"] = {row[0]: row[3] for row in rows if row[3] in ("holds", "fails")}
    s["verdict"] = "holds" if all(v == "holds" for v in s["verdicts"].values()) else "fails"
    print(f"verdict: {s['verdict']}")
    import rollout_farm

    code = {**provenance(), "rollout_farm": str(Path(rollout_farm.__file__).parent)}  # the code the service ran
    write_json("adapter_churn", {"args": vars(args), "resident": RESIDENT, "code": code, **s})


if __name__ == "__main__":
    main()
