"""The HTTP checks of bench/compose_smoke.sh, one subcommand each, so that the shell script stays a plain list of
steps. Each check prints one line, `ok <name>: <what it saw>`, or `FAILED <name>: <why>` and exits 1; the figures it
measures go into the JSON file SMOKE_JSON (merged, key by key). The service is FARM_URL with the token FARM_API_TOKEN;
every call has a timeout, and every wait a deadline."""

import argparse
import json
import os
import sys
import time
from pathlib import Path

import httpx
import openai

URL = os.environ.get("FARM_URL", "http://127.0.0.1:8000")
TOKEN = os.environ.get("FARM_API_TOKEN", "")
AUTH = {"Authorization": f"Bearer {TOKEN}"}
PROMPT = {"text": "Q: 37+8\nA:", "ground_truth": "45"}
SHORT = {"max_new_tokens": 8, "temperature": 1.0}
QUEUE_SOURCE = "smoke"


def record(**figures) -> None:
    path = Path(os.environ["SMOKE_JSON"])
    data = json.loads(path.read_text()) if path.exists() else {}
    data.update(figures)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def ok(name: str, seen: str) -> None:
    print(f"ok {name}: {seen}", flush=True)


def fail(name: str, why: str):
    print(f"FAILED {name}: {why}", flush=True)
    sys.exit(1)


def client(timeout: float = 120) -> httpx.Client:
    return httpx.Client(base_url=URL, timeout=timeout)


def committed_version() -> int:
    with client(30) as c:
        return c.get("/v1/weights/version").raise_for_status().json()["version"]


def wait_healthy(args) -> None:
    """/healthz answers 200 (every engine replica samples a token); the seconds since `--since` (epoch)."""
    deadline = time.monotonic() + args.timeout
    last = "no answer yet"
    while time.monotonic() < deadline:
        try:
            with client(30) as c:
                answer = c.get("/healthz")
            if answer.status_code == 200:
                seconds = round(time.time() - args.since, 1)
                record(**{args.figure: seconds})
                return ok(args.name, f"/healthz 200 after {seconds} s")
            last = f"/healthz {answer.status_code}"
        except httpx.HTTPError as e:
            last = repr(e)
        time.sleep(2)
    fail(args.name, f"not healthy within {args.timeout} s ({last})")


def generation(args) -> None:
    """The token rule (a rollout without the token is refused), then a rollout, an OpenAI chat completion and a
    session turn, each with the token."""
    with client() as c:
        refused = c.post("/v1/rollouts", json={"prompts": [PROMPT], "n": 1, "sampling_params": SHORT})
        if refused.status_code != 401:
            fail("token", f"a rollout without the token got {refused.status_code}, not 401: {refused.text[:200]}")
        ok("token", "a rollout without the token: 401 (FARM_REQUIRE_TOKEN_FOR_GENERATION on)")
        answer = c.post("/v1/rollouts", headers=AUTH, json={"prompts": [PROMPT], "n": 2, "sampling_params": SHORT})
        if answer.status_code != 200:
            fail("rollout", f"{answer.status_code}: {answer.text[:300]}")
        samples = answer.json()["groups"][0]["samples"]
        ok("rollout", f"{len(samples)} samples, weight_version {samples[0]['weight_version']}, {samples[0]['text']!r}")

        sdk = openai.OpenAI(base_url=f"{URL}/v1", api_key=TOKEN, max_retries=0, timeout=120)
        chat = sdk.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "37+8?"}], max_tokens=8, temperature=1.0
        )
        ok("openai chat", f"finish_reason {chat.choices[0].finish_reason}, {chat.choices[0].message.content!r}")

        session = c.post("/v1/sessions", headers=AUTH, json={"sampling_params": SHORT})
        if session.status_code != 200:
            fail("session turn", f"POST /v1/sessions: {session.status_code}: {session.text[:300]}")
        turn_sdk = openai.OpenAI(base_url=session.json()["base_url"], api_key=TOKEN, max_retries=0, timeout=120)
        turn = turn_sdk.chat.completions.create(model="policy", messages=[{"role": "user", "content": "12-3?"}])
        trajectory = c.get(f"/v1/sessions/{session.json()['session_id']}/trajectory", headers=AUTH)
        if trajectory.status_code != 200:
            fail("session turn", f"trajectory: {trajectory.status_code}: {trajectory.text[:300]}")
        ok("session turn", f"{turn.choices[0].message.content!r}; trajectory read back ({trajectory.status_code})")


def version(args) -> None:
    """Print the committed weight version (for the script), and record it."""
    v = committed_version()
    if args.figure:
        record(**{args.figure: v})
    print(v)


def trainer_run(args) -> None:
    """The trainer's metrics.jsonl: the steps it ran and the weight version each pushed; the farm commits the last."""
    steps = [json.loads(line) for line in Path(args.metrics).read_text().splitlines() if line.strip()]
    if len(steps) < args.steps:
        fail("trainer", f"{len(steps)} steps logged, {args.steps} asked")
    versions = [s["weight_version"] for s in steps]
    now = committed_version()
    if now <= args.before or now != versions[-1]:
        fail("trainer", f"committed version {now} (before: {args.before}); the trainer's versions {versions}")
    folders = sorted(args.step_folders.split())
    if f"v{now}" not in folders:  # compose's trainer pushes by path: trainer.push_dir=/data/weights/steps
        fail("trainer", f"pushed by path: no v{now} in /data/weights/steps (found {folders})")
    record(
        train_steps=len(steps),
        weight_pushes=now - args.before,
        committed_version_after_training=now,
        step_folders_on_volume=folders,
    )
    ok(
        "trainer",
        f"{len(steps)} GRPO steps, weight versions {versions}: the farm commits {now} (was {args.before}); "
        f"pushed by path, /data/weights/steps holds {folders}",
    )


def prometheus(args) -> None:
    """Prometheus's targets API and its history: every job in `--jobs` was scraped up (the trainer may have finished
    its few steps and gone since: `max_over_time(up[1h])` remembers its scrapes); its rules API: the alert rules
    loaded, with no rule in error. Waits up to --timeout for the first scrapes."""
    deadline, jobs, seen = time.monotonic() + args.timeout, set(args.jobs.split(",")), {}
    while time.monotonic() < deadline:
        try:
            with httpx.Client(base_url=args.url, timeout=10) as c:
                targets = c.get("/api/v1/targets").raise_for_status().json()["data"]["activeTargets"]
                history = c.get("/api/v1/query", params={"query": "max by (job) (max_over_time(up[1h]))"})
            seen = {t["labels"]["job"]: t["health"] for t in targets}
            for sample in history.raise_for_status().json()["data"]["result"]:
                if sample["value"][1] == "1" and seen.get(sample["metric"]["job"]) != "up":
                    seen[sample["metric"]["job"]] = "up (scraped, since gone)"
            if all(seen.get(job, "").startswith("up") for job in jobs):
                break
        except httpx.HTTPError as e:
            seen = {"error": repr(e)}
        time.sleep(3)
    else:
        fail("prometheus targets", f"wanted {sorted(jobs)} up within {args.timeout} s; saw {seen}")
    ok("prometheus targets", ", ".join(f"{job} {health}" for job, health in sorted(seen.items())))
    with httpx.Client(base_url=args.url, timeout=10) as c:
        groups = c.get("/api/v1/rules").raise_for_status().json()["data"]["groups"]
    rules = [r for g in groups for r in g["rules"]]
    broken = [r["name"] for r in rules if r.get("health") == "err"]
    if not rules or broken:
        fail("alert rules", f"{len(rules)} loaded, in error: {broken}")
    record(alert_rules_loaded=len(rules))
    ok("alert rules", f"{len(rules)} rules in {len(groups)} groups loaded, none in error")


def queue_put(args) -> None:
    """A prompt source of two prompts kept one group ahead: one group generated (ready) and one prompt pending."""
    source = {"name": QUEUE_SOURCE, "n": 2, "target_groups": 1, "sampling_params": SHORT, "prompts": [PROMPT] * 2}
    with client() as c:
        made = c.post("/v1/queue/sources", headers=AUTH, json=source)
        if made.status_code != 200:
            fail("queue", f"POST /v1/queue/sources: {made.status_code}: {made.text[:300]}")
        state = wait_for_source(c, lambda s: s["ready"] == 1 and s["pending_prompts"] == 1, args.timeout)
    record(queue_before_restart={"ready": state["ready"], "pending_prompts": state["pending_prompts"]})
    ok("queue", f"source {QUEUE_SOURCE!r}: {state['ready']} group ready, {state['pending_prompts']} prompt pending")


def wait_for_source(c: httpx.Client, done, timeout: float) -> dict:
    deadline, state = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        state = next((s for s in c.get("/v1/queue/sources").json() if s["name"] == QUEUE_SOURCE), None)
        if state and done(state):
            return state
        time.sleep(1)
    fail("queue", f"source {QUEUE_SOURCE!r} within {timeout} s: {state}")


def after_restart(args) -> None:
    """After `docker compose down` and `up`: the committed version is the one before, the queue's group and pending
    prompt are still there and the group is pulled, and a rollout is served at the committed version."""
    now = committed_version()
    if now != args.version:
        fail("restart: version", f"committed version {now} after the restart, {args.version} before")
    ok("restart: version", f"committed version {now}, as before the restart")
    with client() as c:
        state = wait_for_source(c, lambda s: True, 30)
        if (state["ready"], state["pending_prompts"]) != (1, 1):
            fail("restart: queue", f"source {QUEUE_SOURCE!r} after the restart: {state}")
        pulled = c.post("/v1/queue/pull", headers=AUTH, json={"source": QUEUE_SOURCE, "max_groups": 1, "wait_s": 30})
        items = pulled.json().get("items", []) if pulled.status_code == 200 else []
        if len(items) != 1:
            fail("restart: queue", f"pull after the restart: {pulled.status_code}: {pulled.text[:300]}")
        c.post("/v1/queue/ack", headers=AUTH, json={"item_ids": [items[0]["item_id"]]}).raise_for_status()
        ok("restart: queue", f"1 group ready and 1 prompt pending, as before; pulled {items[0]['item_id']}")
        answer = c.post("/v1/rollouts", headers=AUTH, json={"prompts": [PROMPT], "n": 2, "sampling_params": SHORT})
        if answer.status_code != 200:
            fail("restart: rollout", f"{answer.status_code}: {answer.text[:300]}")
        versions = {s["weight_version"] for s in answer.json()["groups"][0]["samples"]}
        if versions != {now}:
            fail("restart: rollout", f"samples at versions {versions}, committed {now}")
    record(committed_version_after_restart=now)
    ok("restart: rollout", f"served at weight version {now}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    sub = parser.add_subparsers(dest="check", required=True)
    p = sub.add_parser("wait-healthy")
    p.add_argument("--since", type=float, required=True)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--figure", default="time_to_healthy_s")
    p.add_argument("--name", default="healthy")
    p.set_defaults(run=wait_healthy)
    sub.add_parser("generation").set_defaults(run=generation)
    p = sub.add_parser("version")
    p.add_argument("--figure")
    p.set_defaults(run=version)
    p = sub.add_parser("trainer-run")
    p.add_argument("--metrics", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--before", type=int, required=True)
    p.add_argument("--step-folders", default="", help="what /data/weights/steps holds in the service's container")
    p.set_defaults(run=trainer_run)
    p = sub.add_parser("figure", help="record one figure: KEY and its value as JSON")
    p.add_argument("key")
    p.add_argument("value", type=json.loads)
    p.set_defaults(run=lambda args: record(**{args.key: args.value}))
    p = sub.add_parser("prometheus")
    p.add_argument("--url", required=True)
    p.add_argument("--jobs", default="service,ray,trainer")
    p.add_argument("--timeout", type=float, default=180)
    p.set_defaults(run=prometheus)
    p = sub.add_parser("queue-put")
    p.add_argument("--timeout", type=float, default=300)
    p.set_defaults(run=queue_put)
    p = sub.add_parser("after-restart")
    p.add_argument("--version", type=int, required=True)
    p.set_defaults(run=after_restart)
    args = parser.parse_args()
    args.run(args)


if __name__ == "__main__":
    main()
