"""Fuzzing at length: schemathesis over the whole HTTP API, several random seeds, more cases than CI.

Each run is tests/service/test_fuzz.py's fuzz() (coverage, fuzzing and stateful phases from /openapi.json, valid but
expensive values lowered, every pause undone at once) with its own seed. Against a service this script starts in
process (the tests' settings: the default front, two engine replicas, small queues, the tests' plug-ins; the model is
`--model`, by default the embedded arith-tiny that `farm serve` runs), or against one already running (`--url`, e.g.
a `farm serve`, with `--token`). Per seed it reports what CI's test fails on:
  server errors        a 5xx (but the NCCL endpoints' documented 501 on the torch engine)
  schema mismatches    a case valid by the published schema refused by the request's own validation
  model gaps           a model built inside a handler refused the request: its request model lacks that check
  failed checks        schemathesis' checks (undocumented status, schema-valid request rejected, ...)
  errors               schemathesis' own: a request that timed out (120 s), a case it could not build
and the slowest answers (over 10 s). Replay one with `--seed N`, or in CI's test with FARM_FUZZ_SEED=N. The summary
goes to bench/results/fuzz-<time>.json (git-ignored); the exit status is 1 when any run found something.

    .venv/bin/python bench/fuzz.py                                 # 3 seeds x 100 examples per operation, ~10 min each
    .venv/bin/python bench/fuzz.py --seed 1234 --examples 300     # one seed, longer
    .venv/bin/python bench/fuzz.py --url http://127.0.0.1:8000 --token "$FARM_API_TOKEN"
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the tests' fuzz() and plug-ins
os.chdir(ROOT)  # the replicas import tests.farm_plugins from here
# the models' cache as for `farm serve` (tests/conftest.py, imported below, would point it into .venv otherwise)
os.environ.setdefault("FARM_CACHE", str(Path.home() / ".cache" / "rollout-farm"))

from common import RESULTS, log, start_service, stop_service, table  # noqa: E402

TINY_TEMPLATE = (  # the tests' tiny Llama's chat template (tests/conftest.py): roles, so no message renders to nothing
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def model_folder(model: str) -> str:
    """'arith-tiny' (the embedded default, built on first use), 'tiny-llama' (the tests' random tiny Llama, built
    into a temporary folder), or an HF model folder."""
    if model != "tiny-llama":
        return model
    import tempfile

    from transformers import AutoTokenizer

    from rollout_farm.services.models import tiny_llama
    from tests.conftest import CONTEXT

    path = tiny_llama(Path(tempfile.mkdtemp(prefix="farm-fuzz-")) / "tiny-llama", context=CONTEXT)
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = TINY_TEMPLATE
    tok.save_pretrained(path)
    return str(path)


def start(model: str) -> tuple[str, str]:
    """The tests' service settings (tests/conftest.py, service_settings) on `model`; (its URL, its token)."""
    from common import TOKEN

    from tests.conftest import DISCONNECT_GRACE_S, MAX_WEIGHTS_BYTES, MIN_VERSION_WAIT_S

    url = start_service(
        model=model_folder(model),
        replicas=2,
        engine_threads=1,
        max_weights_bytes=MAX_WEIGHTS_BYTES,
        engine_max_ongoing_requests=2,
        engine_max_queued_requests=2,
        min_version_wait_s=MIN_VERSION_WAIT_S,
        disconnect_grace_s=DISCONNECT_GRACE_S,
        plugins=["tests.farm_plugins"],
        log_level="WARNING",
    )
    return url, TOKEN


def found(summary: dict) -> dict[str, int]:
    return {k: len(summary[k]) for k in ("server_errors", "schema_mismatches", "model_gaps", "failures", "errors")}


def grouped(answers: list[list]) -> list[dict]:
    """Answers by operation, status and error message, most frequent first."""
    counts = Counter()
    for method, path, status, text, mode in answers:
        try:
            body = json.loads(text)
            what = body.get("error", "") + " | " + "; ".join(f"{d['field']}: {d['message']}" for d in body["detail"])
        except (ValueError, KeyError, TypeError, AttributeError):
            what = text
        counts[(f"{method} {path}", status, mode, what[:300])] += 1
    return [
        {"operation": o, "status": s, "mode": m, "answer": w, "count": n} for (o, s, m, w), n in counts.most_common()
    ]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3, help="seeds to run, each new and random (without --seed)")
    ap.add_argument("--seed", type=int, action="append", help="run this seed (repeatable); replaces --runs")
    ap.add_argument("--examples", type=int, default=100, help="examples per operation in the fuzzing phase (CI: 20)")
    ap.add_argument("--stateful", type=int, default=50, help="scenarios of the stateful phase (CI: 20)")
    ap.add_argument("--steps", type=int, default=6, help="calls per stateful scenario, at most")
    ap.add_argument("--model", default="arith-tiny", help="arith-tiny (farm serve's default), tiny-llama, or a folder")
    ap.add_argument("--url", help="fuzz this running service instead of starting one")
    ap.add_argument("--token", default=os.environ.get("FARM_API_TOKEN"), help="its token (with --url)")
    args = ap.parse_args()
    from tests.service.test_fuzz import fuzz

    seeds = args.seed or [random.SystemRandom().randrange(2**32) for _ in range(args.runs)]
    url, token = (args.url.rstrip("/"), args.token) if args.url else start(args.model)
    runs = []
    try:
        for seed in seeds:
            log(f"seed {seed}: {args.examples} examples per operation, {args.stateful} stateful scenarios")
            run = fuzz(url, seed, args.examples, args.stateful, args.steps, token)
            summary = run.summary()
            summary["found"] = found(summary)
            for key in ("server_errors", "schema_mismatches", "model_gaps"):
                summary[key] = grouped(summary[key])
            runs.append(summary)
            log(f"seed {seed}: {summary['requests']} requests in {summary['seconds']:.0f} s; found {summary['found']}")
    finally:
        if not args.url:
            stop_service()
    headers = ["seed", "requests", "seconds", "5xx", "schema mismatches", "model gaps", "failed checks", "errors"]
    rows = [[r["seed"], r["requests"], r["seconds"], *r["found"].values()] for r in runs]
    print(table(headers, rows))
    for r in runs:
        for key in ("server_errors", "schema_mismatches", "model_gaps"):
            for g in r[key][:10]:
                what = f"{g['count']}x {g['operation']} {g['status']} ({g['mode']}): {g['answer']}"
                print(f"seed {r['seed']} {key}: {what}")
        for line in [*r["failures"], *r["errors"]]:
            print(f"seed {r['seed']}: {line}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"fuzz-{time.strftime('%Y%m%d-%H%M%S')}.json"
    settings = {"examples": args.examples, "stateful": args.stateful, "steps": args.steps}
    out.write_text(json.dumps({"url": url, "model": args.model, **settings, "runs": runs}, indent=1) + "\n")
    log(f"wrote {out.relative_to(ROOT)}; replay a seed: --seed N, or FARM_FUZZ_SEED=N in tests/service/test_fuzz.py")
    return 1 if any(any(r["found"].values()) for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
