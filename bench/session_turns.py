"""Session turns: does a turn's latency grow with the session's history? (issue 39, item 7)

A token session of --turns turns against the real service (one replica of a tiny random Llama whose context fits
them): POST /v1/sessions, then each turn POST /v1/sessions/{id}/generate with --append new ids (the first turn
--prompt ids) and --sample sampled tokens (ignore_eos). Every turn's latency at the client, --sessions sessions one
after another. The figure: the median of turns 2..(1+W) over all sessions against the median of the last W turns
(W = --window), and their ratio. Goal: <= 1.2.

In the same run, the store's own cost of a turn, in this process against a redis-server of its own (the embedded
one): load, one turn of the same shape appended, save; for a session of 2 turns, of --turns turns and of --big-turns
turns (about 33k tokens, the size issue 39 measured), the median of --store-reps turns on a fresh copy each:
  old  the layout before the append-only store: the session as one JSON value (GET, Session.from_json,
       Session.to_json, SET), as rollout_farm/services/episodes/session_store.py kept it until issue 39
  new  SessionStore.load(whole=False) and SessionStore.save: header, packed columns and lists, one MULTI/EXEC
The turn records (sampled_with, policies) are the service's own, read from the first session's trajectory.
Results: docs/data/session_turns.json.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
from common import TOKEN, add_front_args, data_name, log, start_service, stop_service, table, wait_quiet, write_json
from tqdm import tqdm

CONTEXT = 8192  # the tiny model's context: 200 turns of 16 tokens and then some


def run_sessions(url: str, args) -> tuple[list[list[float]], dict]:
    """Each session's turn latencies in seconds, and the first session's trajectory."""
    headers = {"Authorization": f"Bearer {TOKEN}"}
    sampling = {"max_new_tokens": args.sample, "ignore_eos": True, "temperature": 1.0}
    prompt = [(7 * i) % 200 + 3 for i in range(args.prompt)]
    latencies, trajectory = [], None
    with httpx.Client(headers=headers, timeout=120) as http:
        for s in range(args.sessions):
            sid = http.post(f"{url}/v1/sessions", json={"sampling_params": sampling}).raise_for_status().json()
            sid = sid["session_id"]
            times = []
            for k in tqdm(range(args.turns), desc=f"session {s + 1}/{args.sessions}", unit="turn", file=sys.stderr):
                ids = prompt if k == 0 else [(k + i) % 200 + 3 for i in range(args.append)]
                t = time.perf_counter()
                http.post(f"{url}/v1/sessions/{sid}/generate", json={"append_token_ids": ids}).raise_for_status()
                times.append(time.perf_counter() - t)
            latencies.append(times)
            if trajectory is None:
                trajectory = http.get(f"{url}/v1/sessions/{sid}/trajectory").raise_for_status().json()
            http.delete(f"{url}/v1/sessions/{sid}")
    return latencies, trajectory


def windows(latencies: list[list[float]], window: int) -> dict:
    early = [t for times in latencies for t in times[1 : 1 + window]]  # turns 2..1+W (turn 1 prefills the prompt)
    late = [t for times in latencies for t in times[-window:]]
    e, lt = statistics.median(early), statistics.median(late)
    return {"early_turns": [2, 1 + window], "early_ms": 1000 * e, "late_ms": 1000 * lt, "ratio": lt / e}


def grown(turns: int, args, record: dict):
    """A session of `turns` token turns shaped like the benchmark's (the service's turn record)."""
    from rollout_farm.services.episodes.segments import Segment
    from rollout_farm.services.episodes.session_store import Session

    session = Session("0" * 31 + "1", "hermes", {"max_new_tokens": args.sample}, 0, 600, segments=[Segment("0")])
    for k in range(turns):
        add_turn(session, k, args, record)
    return session


def add_turn(session, k: int, args, record: dict) -> None:
    head, n = session.head, args.sample
    head.add_context(list(range(3, 3 + (args.prompt if k == 0 else args.append))), [])
    head.add_sampled(
        [5 + k % 200] * n,
        [-1.25 - k / 7] * n,
        [-1.5 - k / 9] * n,
        [0] * n,
        "length",
        {"role": "assistant", "content": "x" * n},
        sampled_with=record["sampled_with"],
        sampling_known=record["sampling_known"],
        policies=record["policies"],
    )
    head.from_token_ids = True


async def store_costs(args, record: dict) -> list[dict]:
    """Per session size, the old and the new store's load + one turn + save, in ms (median of --store-reps)."""
    from rollout_farm.services.episodes.session_store import Session, SessionStore
    from rollout_farm.services.state.embedded_redis import EmbeddedRedis
    from rollout_farm.services.state.redis_client import connect

    server = EmbeddedRedis(Path(tempfile.mkdtemp(prefix="session-turns-redis-")))
    server.start()
    r = connect(server.url)
    store = SessionStore(r, "farm:bench")
    rows = []
    try:
        for turns in (2, args.turns, args.big_turns):
            base, old, new = grown(turns - 1, args, record), [], []
            key = store.key(base.id)
            for _ in range(args.store_reps):
                await r.set(key, base.to_json())
                t = time.perf_counter()
                session = Session.from_json(await r.get(key))
                add_turn(session, turns - 1, args, record)
                await r.set(key, session.to_json(), ex=600)
                old.append(time.perf_counter() - t)
                await r.delete(key)
                await store.create(grown(0, args, record))
                copy = Session.from_json(base.to_json())
                copy.held = (await store.load(base.id, whole=False)).held
                await store.save(copy)
                t = time.perf_counter()
                session = await store.load(base.id, whole=False)
                add_turn(session, turns - 1, args, record)
                await store.save(session)
                new.append(time.perf_counter() - t)
                await store.delete(base.id)
            tokens = len(base.head.token_ids) + args.append + args.sample
            old_ms, new_ms = 1000 * statistics.median(old), 1000 * statistics.median(new)
            rows.append({"turn": turns, "tokens": tokens, "old_ms": old_ms, "new_ms": new_ms})
            log(f"store at turn {turns} ({tokens} tokens): old {old_ms:.2f} ms, new {new_ms:.2f} ms")
    finally:
        await r.aclose()
        server.stop()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--turns", type=int, default=200)
    ap.add_argument("--sessions", type=int, default=5, help="sessions run one after another")
    ap.add_argument("--prompt", type=int, default=16, help="ids the first turn appends")
    ap.add_argument("--append", type=int, default=8, help="ids each later turn appends")
    ap.add_argument("--sample", type=int, default=8, help="tokens sampled per turn")
    ap.add_argument("--window", type=int, default=10, help="turns per window: 2..1+W against the last W")
    ap.add_argument("--store-reps", type=int, default=15)
    ap.add_argument("--big-turns", type=int, default=2000, help="the large session of the store's cost")
    ap.add_argument("--out", default="session_turns", help="docs/data/<out>.json (with the front's suffix)")
    add_front_args(ap)
    args = ap.parse_args()

    from rollout_farm.services.models import tiny_llama

    model = tiny_llama(Path(tempfile.mkdtemp(prefix="session-turns-")) / "tiny-llama", context=CONTEXT)
    wait_quiet()
    url = start_service(
        model=str(model),
        replicas=1,
        engine_threads=1,
        front=args.front,
        http_proxy=args.http_proxy,
        log_level="WARNING",
    )
    try:
        latencies, trajectory = run_sessions(url, args)
    finally:
        stop_service()
    turn = trajectory["segments"][-1]["turns"][-1]
    record = {k: turn[k] for k in ("sampled_with", "sampling_known", "policies")}
    store = asyncio.run(store_costs(args, record))
    figure = windows(latencies, args.window)
    print(table(["turns", "early ms", "late ms", "ratio"], [[f"2-{1 + args.window} vs last {args.window}",
          figure["early_ms"], figure["late_ms"], figure["ratio"]]]))  # fmt: skip
    print(table(["turn", "tokens", "old store ms", "new store ms"], [list(r.values()) for r in store]))
    write_json(
        data_name(args.out, args.front, args.http_proxy),
        {
            "settings": {k: getattr(args, k) for k in ("turns", "sessions", "prompt", "append", "sample", "window")},
            "model": f"tiny random Llama (hidden 64, 2 layers, context {CONTEXT}), 1 replica",
            "front": args.front,
            "http_proxy": args.http_proxy,
            "figure": figure,
            "goal": "late / early <= 1.2",
            "store_per_turn": store,
            "turn_latency_ms": [[round(1000 * t, 2) for t in times] for times in latencies],
        },
    )


if __name__ == "__main__":
    main()
