"""The farm's engines side by side (issue 41): vLLM alone, the farm on vLLM, the farm on its own torch engine.

Three arms, each generating the same prompts, float32, eager, the same threads (--threads) and KV cache
(--kv-cache-gib, vLLM's VLLM_CPU_KVCACHE_SPACE; VLLM_CPU_OMP_THREADS_BIND=nobind, as the farm sets them):
  vllm_alone  vLLM's offline Python API, `vllm.LLM(...).generate` on TokensPrompt inputs with SamplingParams(n,
              logprobs=0), in vLLM's own environment (bench/engines_vllm_alone.py, one process per model, kept
              across rounds): the engine a user would run instead of the farm
  farm_vllm   the farm on vLLM: VLLMEngine.agenerate, the call an engine replica makes (its vLLM server over a Unix
              socket, one request per distinct prompt with n its count)
  farm_torch  the farm on its own engine: TorchEngine.agenerate
Shapes: `distinct` (--prompts distinct random prompts of 32 tokens, one sample each) and `groups` (--groups random
prompts of --group-prompt-tokens tokens, --group-size samples each; the farm's engines get a group as the same
prompt repeated in one call). Every sample runs --new-tokens tokens (ignore_eos), temperature 1, logprobs on. The
prompts are new each round, so no arm finds the last round's prompts in a cache. Seeded (each round's index) unless
--unseeded. vLLM alone runs with the farm's scheduler settings (no chunked prefill, max_num_batched_tokens the
context or 2048): on vllm-cpu 0.32.0 a seeded request whose prefill is split over steps kills the engine ("CPU
Generator does not use offset", vllm/v1/worker/gpu_model_runner.py, _bookkeeping_sync), so the farm never splits one.

Each engine is built once per model and reused (a vLLM engine takes ~25 s to start); an untimed warm-up call first.
Each round runs every arm once per shape, the arms' order rotating between rounds, so a round's three figures saw
the same load on the (shared) machine: the figure is generated tokens/s, and the ratios are paired by round, their
geometric mean with a 95% t interval (common.interval) and a verdict: farm_vllm / vllm_alone against the goal 0.9,
farm_vllm / farm_torch against 1 (which engine is faster). Results: docs/data/engines.json; bench/README.md's
table between `<!-- engines:begin -->` and `<!-- engines:end -->` is rebuilt from it.

    .venv/bin/python bench/engines.py                # about 20 min on 2 cores: both models, 3 rounds
    .venv/bin/python bench/engines.py --quick        # a smoke run: small shapes, 2 rounds, no files written
    .venv/bin/python bench/engines.py --report       # seconds: bench/README.md's table from docs/data/engines.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import (  # noqa: E402
    DATA,
    ROOT,
    CpuMeter,
    interval,
    log,
    provenance,
    quartiles,
    resolve,
    verdict,
    wait_quiet,
    write_json,
    write_section,
)

ARMS = ("vllm_alone", "farm_vllm", "farm_torch")
NAMES = {"vllm_alone": "vLLM alone", "farm_vllm": "farm on vLLM", "farm_torch": "farm on torch"}
MODELS = {"smollm2": "SmolLM2-135M", "arith-tiny": "arith-tiny"}
GOAL = 0.9  # farm on vLLM / vLLM alone
DISTINCT_PROMPT_TOKENS = 32
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
ALONE = Path(__file__).with_name("engines_vllm_alone.py")
README = ROOT / "bench" / "README.md"
JSON = DATA / "engines.json"
BEGIN, END = "<!-- engines:begin -->", "<!-- engines:end -->"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=list(MODELS), help="smollm2, arith-tiny or HF model folders")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=64, help="distinct: prompts, one sample each")
    ap.add_argument("--groups", type=int, default=8, help="groups: distinct prompts")
    ap.add_argument("--group-size", type=int, default=8, help="groups: samples per prompt")
    ap.add_argument("--group-prompt-tokens", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--kv-cache-gib", type=int, default=1)
    ap.add_argument("--quiet-wait-s", type=float, default=10.0, help="before a round, wait up to this for idle cores")
    ap.add_argument("--unseeded", action="store_true", help="no seed (the farm's rollouts are usually seeded)")
    ap.add_argument("--quick", action="store_true", help="a smoke run: small shapes, 2 rounds, no files written")
    ap.add_argument("--report", action="store_true", help="only rebuild bench/README.md's table from the data")
    args = ap.parse_args()
    if args.report:
        return rebuild_readme()
    if args.quick:
        args.rounds, args.prompts, args.groups, args.group_size = 2, 8, 2, 4
        args.group_prompt_tokens, args.new_tokens = 64, 16
    shapes = {
        "distinct": {"prompts": args.prompts, "n": 1, "prompt_tokens": DISTINCT_PROMPT_TOKENS},
        "groups": {"prompts": args.groups, "n": args.group_size, "prompt_tokens": args.group_prompt_tokens},
    }
    data = {"args": vars(args), "provenance": provenance(), "shapes": shapes, "start_s": {}, "cases": {}}
    for model in args.models:
        start_s, cases = run_model(model, shapes, args)
        data["start_s"][model] = start_s
        data["cases"].update(cases)
    print(render(data))
    if args.quick:
        log("--quick: nothing written")
        return
    write_json("engines", data)
    rebuild_readme()


def run_model(model: str, shapes: dict, args) -> tuple[dict, dict]:
    """Build the three arms on `model`, run the rounds, close them; (start seconds per arm, cases)."""
    path = resolve(model)
    engines, start_s = {}, {}
    try:
        for arm in ARMS:
            t = time.perf_counter()
            engines[arm] = build(arm, path, args)
            start_s[arm] = time.perf_counter() - t
            log(f"{model}: {arm} up in {start_s[arm]:.0f} s")
        warm = [[5 + i for i in range(16)]]
        for arm, engine in engines.items():
            engine.run(warm, 2, 8, seed=None)
        rounds = {shape: {arm: [] for arm in ARMS} | {"foreign": []} for shape in shapes}
        bar = tqdm(total=args.rounds * len(shapes), desc=f"engines {model}", unit="round", file=sys.stderr)
        for i in range(args.rounds):
            wait_quiet(threshold=0.25, max_wait_s=args.quiet_wait_s)
            order = ARMS[i % len(ARMS) :] + ARMS[: i % len(ARMS)]
            for shape, s in shapes.items():
                prompts = random_prompts(path, s["prompts"], s["prompt_tokens"], f"{model}-{shape}-{i}")
                foreign = []
                for arm in order:
                    with CpuMeter() as m:
                        seed = None if args.unseeded else i
                        seconds, tokens = engines[arm].run(prompts, s["n"], args.new_tokens, seed)
                    expected = s["prompts"] * s["n"] * args.new_tokens
                    assert tokens == expected, f"{arm}: {tokens} tokens and logprobs, not {expected}"
                    rounds[shape][arm].append(tokens / seconds)
                    foreign.append(m.foreign)
                rounds[shape]["foreign"].append(max(foreign))
                said = ", ".join(f"{a} {rounds[shape][a][-1]:.0f}" for a in ARMS)
                log(f"{model} {shape} round {i + 1}/{args.rounds}: tokens/s {said}; others {max(foreign):.0%}")
                bar.update()
        bar.close()
    finally:
        for engine in engines.values():
            engine.close()
    cases = {f"{model} {shape}": {"model": model, "shape": shape, "tokens_s": r} for shape, r in rounds.items()}
    for case in cases.values():
        case.update(summarise(case["tokens_s"]))
    return start_s, cases


def random_prompts(path: Path, count: int, length: int, seed: str) -> list[list[int]]:
    """`count` prompts of `length` random token ids (no special ones), new for each round's seed."""
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab - 3) for _ in range(length)] for _ in range(count)]


def build(arm: str, path: Path, args):
    if arm == "vllm_alone":
        return VLLMAlone(path, args.threads, args.kv_cache_gib)
    return FarmArm(arm, path, args.threads, args.kv_cache_gib)


class FarmArm:
    """The farm's engine in process, called as a replica calls it: `await engine.agenerate(rows, params)`."""

    def __init__(self, arm: str, path: Path, threads: int, kv_cache_gib: int):
        if arm == "farm_vllm":
            from rollout_farm.services.engine.vllm_engine import VLLMEngine

            self.engine = VLLMEngine(str(path), "cpu", "float32", threads, kv_cache_gib=kv_cache_gib)
        else:
            from rollout_farm.services.engine.torch import TorchEngine

            self.engine = TorchEngine(str(path), "cpu", "float32", threads)
        self.loop = asyncio.new_event_loop()

    def run(self, prompts: list[list[int]], n: int, new_tokens: int, seed: int | None) -> tuple[float, int]:
        """(seconds, generated tokens that came with a logprob) of one call of every prompt n times."""
        from rollout_farm.services.protocol import SamplingParams

        params = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, ignore_eos=True, seed=seed)
        rows = [p for p in prompts for _ in range(n)]
        t = time.perf_counter()
        outs = self.loop.run_until_complete(self.engine.agenerate(rows, params))
        seconds = time.perf_counter() - t
        return seconds, sum(min(len(o.token_ids), len(o.logprobs)) for o in outs)

    def close(self) -> None:
        if hasattr(self.engine, "close"):
            self.engine.close()
        self.loop.close()


class VLLMAlone:
    """bench/engines_vllm_alone.py in vLLM's environment, in a process group of its own; one JSON line per round."""

    def __init__(self, path: Path, threads: int, kv_cache_gib: int):
        if not os.access(VLLM_PYTHON, os.X_OK):
            raise SystemExit(f"{VLLM_PYTHON} is missing: `make vllm-env` builds vLLM's environment")
        env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONHOME", "PYTHONPATH")}
        env |= {"VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib), "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
        env["OMP_NUM_THREADS"] = str(threads)
        context = json.loads((path / "config.json").read_text()).get("max_position_embeddings") or 2048
        self.log = tempfile.NamedTemporaryFile(prefix="engines-vllm-alone-", suffix=".log", delete=False)
        command = [str(VLLM_PYTHON), str(ALONE), "--model", str(path), "--max-model-len", str(context)]
        self.proc = subprocess.Popen(
            command, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
            start_new_session=True,
        )  # fmt: skip
        self._answer()  # {"ready": true}

    def _answer(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            tail = Path(self.log.name).read_text(errors="replace").splitlines()[-30:]
            raise RuntimeError(f"vLLM alone ended ({self.log.name}):\n" + "\n".join(tail))
        return json.loads(line)

    def run(self, prompts: list[list[int]], n: int, new_tokens: int, seed: int | None) -> tuple[float, int]:
        ask = {"prompts": prompts, "n": n, "max_tokens": new_tokens, "seed": seed}
        self.proc.stdin.write(json.dumps(ask) + "\n")
        self.proc.stdin.flush()
        answer = self._answer()
        return answer["seconds"], min(answer["tokens"], answer["logprobs"])

    def close(self) -> None:
        """EOF ends the script; its group (vLLM's engine core too) gets SIGTERM, then SIGKILL."""
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            time.sleep(2)
        self.proc.wait()


def summarise(tokens_s: dict[str, list[float]]) -> dict:
    """Per arm the median and quartiles of tokens/s; the two ratios paired by round, each with its verdict."""
    out = {"median": {a: statistics.median(tokens_s[a]) for a in ARMS}}
    out["quartiles"] = {a: [quartiles(tokens_s[a])[0], quartiles(tokens_s[a])[2]] for a in ARMS}
    for name, (top, bottom, target) in {
        "farm_vllm_over_vllm_alone": ("farm_vllm", "vllm_alone", GOAL),
        "farm_vllm_over_farm_torch": ("farm_vllm", "farm_torch", 1.0),
    }.items():
        ratios = [a / b for a, b in zip(tokens_s[top], tokens_s[bottom])]
        mean, low, high = interval(ratios)
        said = verdict(low, high, target)
        out[name] = {"ratios": ratios, "geometric_mean": mean, "ci95": [low, high], "target": target, "verdict": said}
    said = out["farm_vllm_over_farm_torch"]["verdict"]
    out["faster"] = {"holds": "vLLM", "fails": "torch"}.get(said, "inconclusive")
    return out


def render(data: dict) -> str:
    """bench/README.md's table, from the data's per-round tokens/s alone (the ratios and verdicts recomputed)."""
    head = [
        "model, shape",
        "vLLM alone tokens/s",
        "farm on vLLM",
        "farm on torch",
        f"farm-vLLM / vLLM alone (95% CI): ≥ {GOAL}?",
        "farm-vLLM / farm-torch (95% CI): faster",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for case in data["cases"].values():
        s = summarise(case["tokens_s"])
        cells = [f"{MODELS.get(case['model'], case['model'])}, {case['shape']}"]
        for arm in ARMS:
            lo, hi = s["quartiles"][arm]
            cells.append(f"{s['median'][arm]:,.0f} ({lo:,.0f}-{hi:,.0f})")
        over = s["farm_vllm_over_vllm_alone"]
        cells.append(f"{over['geometric_mean']:.2f} ({over['ci95'][0]:.2f}-{over['ci95'][1]:.2f}): {over['verdict']}")
        vs = s["farm_vllm_over_farm_torch"]
        cells.append(f"{vs['geometric_mean']:.2f} ({vs['ci95'][0]:.2f}-{vs['ci95'][1]:.2f}): {s['faster']}")
        lines.append("| " + " | ".join(cells) + " |")
    a, shapes = data["args"], data["shapes"]
    seeded = "unseeded" if a.get("unseeded", not a.get("seeded")) else "seeded"
    d, g = shapes["distinct"], shapes["groups"]
    rounds = len(next(iter(data["cases"].values()))["tokens_s"]["farm_vllm"])
    others = [f for case in data["cases"].values() for f in case["tokens_s"]["foreign"]]
    lines += [
        "",
        f"Generated tokens/s, medians over {rounds} rounds (quartiles); ratios paired by round: geometric mean (95% t"
        f" interval). distinct: {d['prompts']} prompts of {d['prompt_tokens']} tokens, 1 sample each; groups:"
        f" {g['prompts']} prompts of {g['prompt_tokens']} tokens, {g['n']} samples each; {a['new_tokens']} new tokens"
        f" per sample (ignore_eos), temperature 1, {seeded}, logprobs on;"
        f" float32, eager, {a['threads']} threads,"
        f" {a['kv_cache_gib']} GiB KV cache. Engine start (s): "
        + "; ".join(
            f"{MODELS.get(m, m)} " + ", ".join(f"{NAMES[arm]} {s:.0f}" for arm, s in starts.items())
            for m, starts in data["start_s"].items()
        )
        + f". Commit {data['provenance']['commit'][:7]}, {data['provenance']['date'][:10]},"
        f" {data['provenance']['machine']['cpus']} CPUs, shared: other processes used"
        f" {min(others):.0%}-{max(others):.0%} of the cores during a round (the most of its arms).",
    ]
    return "\n".join(lines) + "\n"


def rebuild_readme(path: Path = JSON) -> None:
    write_section(README, BEGIN, END, render(json.loads(path.read_text())))
    log(f"wrote the table into {README.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
