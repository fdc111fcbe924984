"""One phase of bench/gpu_check.py, run as its child on a GPU machine: start the farm on SGLang under Ray Serve, run
the phase's checks in order, stop it. Usage (gpu_check.py runs it): gpu_check_phases.py PHASE MODEL CHECKS

For each check it writes `BEGIN <check>` before and `RESULT {"status", "name", "detail"}` after, one line each, to
the protocol pipe gpu_check.py gives it ($GPU_CHECK_FD; stdout without it); everything else goes to the log. A check
is a function of the running Farm that returns its figure (PASS), raises Skip (SKIP, with the reason) or raises
anything else (FAIL, with the error's first line). When the serve check fails, the phase's other checks are SKIPs.

What each check drives is the project's own: the service started as `farm serve` starts it (serving/server.py), the
rollout through FarmClient, the session routes through FarmClient's authorised httpx client, the trainer's TrainingRun
and train_step, the weight routes /v1/weights/path and /v1/weights/distributed (tests/gpu/test_sglang.py drives the
engine's NCCL verbs alone; here the farm's routes carry them, as a trainer would).
"""

from __future__ import annotations

import atexit
import functools
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.gpu_check import PROTOCOL_FD  # noqa: E402

# Serve drains a replica behind HAProxy (the default front) at least 30 s before it stops; the checks' traffic is over
# by then, and the phase's stop has STOP_S (tests/conftest.py does the same). Ray's processes inherit it.
os.environ.setdefault("RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", "2")
TOKEN = "gpu-check-token-0123456789"
TOLERANCE = {"rel": 1e-3, "abs": 1e-5}  # tests/gpu/test_cuda.py's, for the CUDA trainer against the CPU one
GROUP_TIMEOUT_S = 30  # push_nccl's process group: its join and broadcast fail after this, not after 30 minutes
TRAINER_DEVICES = ("cpu", "cuda")  # trainer_step's two trainers: the reference first
PROMPTS = ["Q: 12+3\nA:", "Q: 7*6\nA:", "hello there", "Q: 100-1\nA:", "Q: 5+5\nA:", "Q: 9*9\nA:", "abc", "Q: 1+1\nA:"]


class Skip(Exception):
    """A check that cannot run here; the message says why and what to install."""


@functools.cache
def protocol():
    """The protocol pipe as a line-buffered text file, not inherited by the processes this one starts."""
    fd = int(os.environ.get(PROTOCOL_FD, sys.stdout.fileno()))
    if fd != sys.stdout.fileno():
        os.set_inheritable(fd, False)
    return os.fdopen(fd, "w", buffering=1, closefd=fd != sys.stdout.fileno())


def say(kind: str, text: str) -> None:
    protocol().write(f"{kind} {text}\n")


@dataclass
class Farm:
    """The running service and what the checks share: its URL, a client, the model folder and its tokenizer."""

    url: str
    model: Path
    client: object  # FarmClient
    tokenizer: object


# the model -------------------------------------------------------------------------------------------------------
def model_folder(model: str) -> Path:
    """'tiny': a random 2-layer Llama with head_dim 64 (tests/gpu/test_sglang.py's), built once into the cache; else
    bench/common.py's resolve: arith-tiny, smollm2 or a folder."""
    if model != "tiny":
        from bench.common import resolve

        return resolve(model)
    from rollout_farm.services.models import CACHE, tiny_llama

    out = CACHE / "models" / "gpu-check-tiny"
    if not (out / "config.json").exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix="gpu-check-tiny-", dir=out.parent))
        tiny_llama(tmp, hidden=256, layers=2, seed=0)  # 4 heads: head_dim 64, which SGLang's kernels take
        os.replace(tmp, out)
    return out


def gpu_memory() -> tuple[str, float, float] | None:
    """GPU 0's name and its memory in use and in all, in GiB, as nvidia-smi reports them (every process's); None
    without nvidia-smi or an answer it can read."""
    if not shutil.which("nvidia-smi"):
        return None
    query = ["nvidia-smi", "--query-gpu=name,memory.used,memory.total", "--format=csv,noheader,nounits", "-i", "0"]
    try:
        name, used, total = subprocess.run(query, capture_output=True, text=True, timeout=10).stdout.split(",")
        return name.strip(), float(used) / 1024, float(total) / 1024
    except (ValueError, subprocess.TimeoutExpired):
        return None


def shown_memory() -> str:
    if memory := gpu_memory():
        return f"{memory[0]}: {memory[1]:.1f} of {memory[2]:.1f} GiB in use"
    return "GPU memory unknown (no nvidia-smi reading)"


def wait_for_free_gpu(limit_s: float = 30) -> None:
    """Wait, up to `limit_s`, while over a tenth of the GPU's memory is in use: the processes of the phase before
    (SGLang's schedulers die with their Ray workers) may still be letting theirs go, and SGLang sizes its KV cache
    from what is free when it starts."""
    deadline = time.monotonic() + limit_s
    while (memory := gpu_memory()) and memory[1] > memory[2] / 10 and time.monotonic() < deadline:
        time.sleep(1)


# serve -----------------------------------------------------------------------------------------------------------
def serve(model: str, share: float, replicas: int) -> tuple[Farm, str]:
    """The farm on SGLang: `replicas` engine replicas at `share` GPU each, bfloat16, a fresh state folder."""
    began = time.perf_counter()
    wait_for_free_gpu()
    folder = model_folder(model)
    from transformers import AutoTokenizer

    from rollout_farm.services.client import FarmClient
    from rollout_farm.services.config.settings import ServiceSettings
    from rollout_farm.services.net import free_port
    from rollout_farm.services.serving import server

    settings = ServiceSettings(
        api_token=TOKEN,
        port=free_port(),
        model=str(folder),
        engine="sglang",
        device="cuda",
        dtype="bfloat16",
        replicas=replicas,
        engine_num_gpus=share,
        state_dir=tempfile.mkdtemp(prefix="gpu-check-state-"),
    )
    atexit.register(shutil.rmtree, settings.state_dir, ignore_errors=True)
    server.start(settings, on_ray_started=stop_on_sigterm)
    url = f"http://127.0.0.1:{settings.port}"
    farm = Farm(url, folder, FarmClient(url, TOKEN), AutoTokenizer.from_pretrained(folder))
    served = farm.client.weights_version()
    if len(served.replicas) != replicas or served.unreachable:
        raise AssertionError(f"{len(served.replicas)} of {replicas} replicas answer; unreachable: {served.unreachable}")
    fraction, tp = settings.sglang_parallelism
    shown = f"mem_fraction_static {fraction}" if fraction is not None else "SGLang's own mem_fraction_static"
    return farm, (
        f"{replicas} replica(s) at {share} GPU ({shown}, tp {tp}) ready in {time.perf_counter() - began:.0f} s; "
        f"{shown_memory()}"
    )


def stop_on_sigterm() -> None:
    """SIGTERM (gpu_check.py stopping an overrun phase) exits through the finally that stops the service; set again
    after ray.init, whose handler would abort instead."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


# the checks ------------------------------------------------------------------------------------------------------
def sample_problems(groups) -> list[str]:
    """What is wrong with a rollout's samples: errors, empty ones, logprobs missing, not finite or above 0."""
    out = []
    for g in groups:
        for s in g.samples:
            if s.finish_reason == "error" or not s.token_ids or len(s.logprobs) != len(s.token_ids):
                out.append(f"{s.finish_reason}: {len(s.token_ids)} tokens, {len(s.logprobs)} logprobs")
            elif not all(math.isfinite(x) and x <= 1e-4 for x in s.logprobs):
                out.append(f"logprobs out of range: {s.logprobs[:4]}")
    return out


def rollout(farm: Farm, prompts: int = 8, n: int = 4) -> str:
    from rollout_farm.services import protocol as P

    req = P.RolloutRequest(
        prompts=[P.Prompt(text=t) for t in PROMPTS[:prompts]],
        n=n,
        sampling_params=P.SamplingParams(temperature=1.0, max_new_tokens=32),
    )
    began = time.perf_counter()
    groups = farm.client.rollouts(req).groups
    seconds = time.perf_counter() - began
    if problems := sample_problems(groups):
        raise AssertionError(f"{len(problems)} bad samples, e.g. {problems[0]}")
    tokens = sum(len(s.token_ids) for g in groups for s in g.samples)
    versions = sorted({s.weight_version for g in groups for s in g.samples})
    return (
        f"{prompts} prompts x {n}: {tokens} tokens in {seconds:.2f} s ({tokens / seconds:.0f} tokens/s), "
        f"weight version {versions}"
    )


def greedy(farm: Farm, min_version: int = 0) -> tuple[list[list[int]], int]:
    """Greedy samples of the first two prompts, and the version that drew them."""
    from rollout_farm.services import protocol as P

    req = P.RolloutRequest(
        prompts=[P.Prompt(text=t) for t in PROMPTS[:2]],
        sampling_params=P.SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True),
        min_weight_version=min_version,
    )
    groups = farm.client.rollouts(req).groups
    return [g.samples[0].token_ids for g in groups], groups[0].samples[0].weight_version


def rollout_and_greedy(farm: Farm) -> str:
    """rollout(), then the same greedy request twice. Whether they agree is a figure, not a failure: the second finds
    the prompt in SGLang's radix cache, and on a random model's near-tied logits bfloat16's rounding there may pick
    another token."""
    figure = rollout(farm)
    first, second = greedy(farm)[0], greedy(farm)[0]
    same = sum(a == b for x, y in zip(first, second) for a, b in zip(x, y))
    return f"{figure}; greedy twice: {same} of {sum(map(len, first))} tokens the same"


def session_turn(farm: Farm) -> str:
    """Two turns of a token session: the second turn's prompt is the first's, its sampled ids and the new ids."""
    http, tok = farm.client.http, farm.tokenizer
    ids = [tok.encode(t, add_special_tokens=False) for t in ("Q: 12+3\nA:", "\nQ: 7*6\nA:")]
    sid = post(http, "/v1/sessions", {"sampling_params": {"temperature": 0, "max_new_tokens": 8}})["session_id"]
    turns, ms = [], []
    for append in ids:
        began = time.perf_counter()
        turns.append(post(http, f"/v1/sessions/{sid}/generate", {"append_token_ids": append}))
        ms.append((time.perf_counter() - began) * 1000)
    post(http, f"/v1/sessions/{sid}/close", {})
    first, second = turns
    expected = first["prompt_tokens"] + len(first["token_ids"]) + len(ids[1])
    if second["prompt_tokens"] != expected or not second["token_ids"]:
        raise AssertionError(f"turn 2: {second['prompt_tokens']} prompt tokens, expected {expected}; {second}")
    return f"turn 1 {ms[0]:.0f} ms, turn 2 {ms[1]:.0f} ms ({second['prompt_tokens']} prompt tokens, the first's kept)"


def post(http, path: str, body: dict) -> dict:
    r = http.post(path, json=body)
    if r.status_code != 200:
        raise AssertionError(f"POST {path}: {r.status_code} {r.text[:300]}")
    return r.json()


def trainer_step(farm: Farm) -> str:
    """One batch pulled from the farm, then the trainer's step (train_step: no-grad passes, advantages, one PPO
    mini-batch) on it on the CPU and on CUDA from the same weights and seed: losses and grad norm agree within
    TOLERANCE. Rewards are spread over the batch (0..1), so the advantages and the gradient are not zero."""
    import importlib.util

    import torch

    if importlib.util.find_spec("verl") is None:
        raise Skip("the trainer extra is missing: no verl (pip install -e '.[trainer]')")
    from rollout_farm.trainer.config import load
    from rollout_farm.trainer.loop import train_step
    from rollout_farm.trainer.run import TrainingRun
    from rollout_farm.trainer.sync import rollouts

    overrides = [
        f"trainer.service_url={farm.url}",
        f"actor_rollout_ref.model.path={farm.model}",
        "trainer.task=arith",
        "data.train_batch_size=4",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",  # one optimizer step: both sides from the same weights
        "trainer.resume_mode=disable",
    ]
    runs = [TrainingRun(load(None, [*overrides, f"trainer.device={d}"]), TOKEN) for d in TRAINER_DEVICES]
    batch = rollouts.pull(runs[0])
    batch = replace(batch, rewards=torch.linspace(0, 1, len(batch)))
    rows = []
    for run in runs:
        torch.manual_seed(0)  # the mini-batches' order
        rows.append(train_step(run, batch.to(run.device)))
    cpu, cuda = rows
    keys = ("pg_loss", "grad_norm", "entropy")
    bad = [k for k in keys if abs(cuda[k] - cpu[k]) > max(TOLERANCE["abs"], TOLERANCE["rel"] * abs(cpu[k]))]
    shown = ", ".join(f"{k} {cpu[k]:.6g} / {cuda[k]:.6g}" for k in keys)
    if bad:
        raise AssertionError(f"CPU / CUDA differ beyond {TOLERANCE} in {bad}: {shown}")
    return f"{len(batch)} samples, CPU / CUDA: {shown} (within rel {TOLERANCE['rel']})"


def changed_weights(farm: Farm, shift: int) -> tuple[dict, str]:
    """The model's canonical state dict in bfloat16 with its output head (the embedding when tied) rolled `shift`
    rows: every logit moves to another token id, so greedy tokens change. Returns it and the head's name."""
    import torch
    from transformers import AutoModelForCausalLM

    from rollout_farm.services.weights.state_dict import cpu_state_dict

    state = cpu_state_dict(AutoModelForCausalLM.from_pretrained(farm.model, dtype=torch.bfloat16))
    head = "lm_head.weight" if "lm_head.weight" in state else "model.embed_tokens.weight"
    state[head] = torch.roll(state[head], shift, dims=0).contiguous()
    return state, head


def push_path(farm: Farm) -> str:
    from safetensors.torch import save_file

    state, head = changed_weights(farm, 1)
    before, _ = greedy(farm)
    version = farm.client.weights_version().version + 1
    with tempfile.TemporaryDirectory(prefix="gpu-check-push-") as folder:
        save_file(state, f"{folder}/model.safetensors")
        pushed = farm.client.push_weights_path(folder, version)
        return served_and_changed(farm, version, before, f"{pushed.tensors} tensors in {pushed.seconds:.2f} s")


def served_and_changed(farm: Farm, version: int, before: list[list[int]], figure: str) -> str:
    after, drawn = greedy(farm, version)
    served = farm.client.weights_version().version
    if (served, drawn) != (version, version):
        raise AssertionError(f"pushed version {version}; served {served}, sampled at {drawn}")
    if after == before:
        raise AssertionError(f"version {version} serves, but greedy tokens did not change: {after[0][:8]}")
    return f"version {version}: {figure}; greedy tokens changed"


def push_nccl(farm: Farm) -> str:
    """The farm's distributed push as a trainer makes it: this process is rank 0 of a group with the engine; it
    joins (POST /v1/weights/distributed/init) and broadcasts the changed head while POST /v1/weights/distributed
    waits for it. NCCL allows one rank per GPU (it refuses two on one device), so with one GPU the same routes run
    over gloo, which carries CUDA tensors through the host; with two or more, NCCL from the last GPU (Ray gives the
    engine the first)."""
    import torch
    from sglang.srt.utils import init_custom_process_group

    from rollout_farm.services.net import free_port

    gpus = torch.cuda.device_count()
    backend, device = ("nccl", f"cuda:{gpus - 1}") if gpus > 1 else ("gloo", "cuda:0")
    state, head = changed_weights(farm, 2)
    tensor = state[head].to(device)
    before, _ = greedy(farm)
    port, group_name, http = free_port(), "gpu_check", farm.client.http
    group_body = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2}
    group_body |= {"group_name": group_name, "backend": backend}
    joined = Call(lambda: post(http, "/v1/weights/distributed/init", group_body))
    with farm_error_first(joined):  # a refused join leaves this side waiting for its peer: the refusal says why
        group = init_custom_process_group(
            backend=backend,
            init_method=f"tcp://127.0.0.1:{port}",
            world_size=2,
            rank=0,
            group_name=group_name,
            timeout=timedelta(seconds=GROUP_TIMEOUT_S),
        )
    joined.result()
    version = farm.client.weights_version().version + 1
    began = time.perf_counter()
    update = {"names": [head], "dtypes": ["BF16"], "shapes": [list(tensor.shape)], "version": version}
    pushed = Call(lambda: post(http, "/v1/weights/distributed", update | {"group_name": group_name}))
    with farm_error_first(pushed):
        torch.distributed.broadcast(tensor, src=0, group=group)
    pushed.result()
    seconds = time.perf_counter() - began
    how = "NCCL" if backend == "nccl" else "gloo, not NCCL (one GPU: NCCL takes one rank per device)"
    return served_and_changed(farm, version, before, f"over {how}, {head} in {seconds:.2f} s")


class Call:
    """fn() in a thread (an HTTP call that waits for this process's part); result() joins it and returns or
    raises what it did."""

    def __init__(self, fn):
        self.out: list = []
        self.thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self.thread.start()

    def _run(self, fn) -> None:
        try:
            self.out.append(fn())
        except Exception as e:  # noqa: BLE001 (handed to the caller)
            self.out.append(e)

    def result(self, timeout_s: float | None = None):
        self.thread.join(timeout_s)
        if not self.out:
            raise TimeoutError(f"no answer within {timeout_s} s")
        if isinstance(self.out[0], Exception):
            raise self.out[0]
        return self.out[0]


@contextmanager
def farm_error_first(call: Call):
    """When this side of a collective fails (its peer never came), raise the farm's refusal of `call` instead, if it
    refused within a few seconds: it names the cause."""
    try:
        yield
    except Exception:
        call.thread.join(5)
        if call.out and isinstance(call.out[0], Exception):
            raise call.out[0] from None
        raise


CHECKS = {
    "rollout_half": rollout,
    "rollout": rollout_and_greedy,
    "session_turn": session_turn,
    "trainer_step": trainer_step,
    "push_path": push_path,
    "push_nccl": push_nccl,
}
SHARES = {"half": (0.5, 2), "full": (1.0, 1)}  # phase -> (GPU share per engine replica, replicas)


def report(status: str, name: str, detail: str) -> None:
    say("RESULT", json.dumps({"status": status, "name": name, "detail": detail}))


def failure(e: BaseException) -> str:
    """An error as one line: its type and the first line of its message."""
    traceback.print_exception(e, file=sys.stderr)
    first = (str(e).strip().splitlines() or [""])[0][:300]
    return f"{type(e).__name__}: {first}"


def stop() -> None:
    """Stop the service and Ray, whatever state a failed start left them in: nothing when serve() failed before it
    imported the server; without Ray, its embedded Redis (serve.shutdown would start Ray to look)."""
    server = sys.modules.get("rollout_farm.services.serving.server")
    if server is None:
        return
    import ray

    try:
        if ray.is_initialized():
            server.stop()
        while server.EMBEDDED:
            server.EMBEDDED.pop().stop()
    except Exception as e:  # noqa: BLE001 (the phase's results are out; its log has this)
        failure(e)


def main(phase: str, model: str, names: list[str]) -> None:
    serve_name, rest = names[0], names[1:]
    say("BEGIN", serve_name)
    try:
        farm, figure = serve(model, *SHARES[phase])
    except Exception as e:  # noqa: BLE001 (a FAIL line)
        report("FAIL", serve_name, failure(e))
        for name in rest:
            report("SKIP", name, f"needs {serve_name}, which failed")
        stop()
        return
    report("PASS", serve_name, figure)
    try:
        for name in rest:
            say("BEGIN", name)
            try:
                report("PASS", name, CHECKS[name](farm))
            except Skip as e:
                report("SKIP", name, str(e))
            except Exception as e:  # noqa: BLE001 (a FAIL line)
                report("FAIL", name, failure(e))
    finally:
        stop()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3].split(","))
