"""An adapter-only push against a full push of the base, to every replica of a real service (2 replicas).

SmolLM2-135M-Instruct (float32, 540 MB) served by the torch engine on two replicas; a rank-8 peft adapter on every
attention and MLP projection of it (about 4.9 MB). Each round pushes the full base weights (the trainer's
WeightPusher in its default mode "full", as `farm train` pushes them; the previous round's adapter retired first,
untimed) and then the adapter (the client's push_adapter, a new version), alternating which goes first. The
figure: adapter push time over full push time, the geometric mean over --rounds rounds with a 95% t interval;
target <= 0.05 (holds, fails or inconclusive).

    .venv/bin/python bench/adapter_push.py                  # about 4 min on 2 cores
    .venv/bin/python bench/adapter_push.py --model arith-tiny --rounds 3
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from common import TOKEN, interval, log, resolve, start_service, stop_service, table, verdict, wait_quiet, write_json

TARGET = 0.05
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--replicas", type=int, default=2)
    args = ap.parse_args()

    import torch
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from rollout_farm.services.client import FarmClient
    from rollout_farm.services.weights.pusher import WeightPusher

    base = resolve(args.model)
    folder = Path(tempfile.mkdtemp(prefix="adapter-push-"))
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
        LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS),
    )
    model.save_pretrained(folder)
    state = {k: v.contiguous() for k, v in load_file(next(base.glob("*.safetensors"))).items()}
    full_bytes = sum(t.numel() * t.element_size() for t in state.values())
    adapter_bytes = (folder / "adapter_model.safetensors").stat().st_size
    url = start_service(model=str(base), replicas=args.replicas, engine_threads=1, max_weights_bytes=4 << 30)
    rows, ratios = [], []
    try:
        with FarmClient(url, TOKEN) as client:
            pusher = WeightPusher(client)
            version = client.weights_version().version
            while len(ratios) < args.rounds:
                wait_quiet()
                r = len(ratios)
                seconds = {}
                for kind in ("full", "adapter") if r % 2 == 0 else ("adapter", "full"):
                    if kind == "full" and r:  # a base push is refused while an adapter made on it is resident
                        client.retire_adapter("bench")
                    start = time.perf_counter()
                    if kind == "full":
                        version += 1
                        pusher.push(state, version)  # mode "full": every tensor's bytes, as a first push sends
                    else:
                        client.push_adapter("bench", str(folder), r + 1)
                    seconds[kind] = time.perf_counter() - start
                ratios.append(seconds["adapter"] / seconds["full"])
                log(f"round {len(ratios)}: full {seconds['full']:.2f} s, adapter {seconds['adapter']:.3f} s")
    finally:
        stop_service()
    mean, low, high = interval(ratios)
    said = verdict(1 / high, 1 / low, 1 / TARGET)  # "at most TARGET": the inverse ratio at least 1 / TARGET
    rows.append(
        [
            args.model,
            f"{full_bytes / 2**20:.0f} MiB",
            f"{adapter_bytes / 2**20:.1f} MiB",
            f"{mean:.3f}",
            f"{low:.3f}-{high:.3f}",
            f"<= {TARGET}",
            said,
        ]
    )
    print(f"adapter push / full push, {args.replicas} replicas, {args.rounds} rounds")
    print(table(["model", "full", "adapter", "time ratio", "95% CI", "target", "verdict"], rows))
    write_json(
        "adapter_push",
        {
            "args": vars(args),
            "full_bytes": full_bytes,
            "adapter_bytes": adapter_bytes,
            "ratios": ratios,
            "geometric_mean": mean,
            "ci95": [low, high],
            "target": TARGET,
            "verdict": said,
        },
    )


if __name__ == "__main__":
    main()
