"""Torch engine, batched LoRA (rollout_farm/services/engine/torch/lora.py): exactness against merged weights, and the
cost of mixing adapters in one batch.

Per model (arith-tiny, and SmolLM2-135M-Instruct), four random rank-8 peft adapters on every linear layer of the
attention and the MLP (their B drawn at random: peft starts B at zero, which would make every adapter the base):

  exactness   each adapter's rows decode in one batch with the other three adapters' rows; their tokens and
              logprobs against an engine serving the base with that adapter merged in by peft (merge_and_unload),
              for greedy, seeded temperature 1, top-p/top-k and regex sampling. The figure: the largest absolute
              logprob difference over every token of every row (float32); target <= 1e-5.
  throughput  the same rows (4 calls of 8 prompts each, arriving together, so they share batches) with each call
              on its own adapter (mixed) and with all four on one adapter (single); temperature 1, 32 new tokens
              (ignore_eos), alternating which goes first. The figure: tokens/s mixed over tokens/s single, the
              geometric mean over --rounds rounds with a 95% t interval; target >= 0.75 (holds, fails or
              inconclusive).

    .venv/bin/python bench/lora_batched.py                    # both models, 5 rounds: about 6 min on 2 cores
    .venv/bin/python bench/lora_batched.py --models arith-tiny --rounds 3
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time
from pathlib import Path

from common import CpuMeter, interval, log, resolve, table, verdict, wait_quiet, write_json

ADAPTERS, RANK, PROMPTS_PER_CALL, NEW_TOKENS = 4, 8, 8, 32
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
EXACT, RATIO = 1e-5, 0.75


def make_adapters(base: Path, root: Path) -> dict[str, Path]:
    """ADAPTERS peft adapters on `base`, by key "a<i>@v1"."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    out = {}
    for i in range(ADAPTERS):
        model = get_peft_model(
            AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
            LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=list(TARGETS)),
        )
        gen = torch.Generator().manual_seed(i)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
        model.save_pretrained(root / f"a{i}")
        out[f"a{i}@v1"] = root / f"a{i}"
    return out


def merged_folder(base: Path, adapter: Path, out: Path) -> Path:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter).merge_and_unload().save_pretrained(
        out
    )
    AutoTokenizer.from_pretrained(base).save_pretrained(out)
    return out


def together(engine, calls: list[tuple[list[list[int]], object, str | None]]) -> tuple[float, list]:
    """The calls (prompts, params, adapter) submitted at once from threads; (wall seconds, outputs per call)."""
    outs: list = [None] * len(calls)

    def run(i):
        prompts, params, adapter = calls[i]
        outs[i] = engine.generate(prompts, params, adapter=adapter)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - start, outs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="arith-tiny,smollm2")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    args = ap.parse_args()

    from safetensors.torch import load_file

    from rollout_farm.services.adapters.peft_format import read_folder
    from rollout_farm.services.engine.torch import TorchEngine
    from rollout_farm.services.extensions.tasks import TASKS
    from rollout_farm.services.protocol import SamplingParams
    from rollout_farm.trainer.sync.rollouts import render_prompt

    kinds = {
        "greedy": SamplingParams(temperature=0, max_new_tokens=16),
        "seeded T=1": SamplingParams(temperature=1.0, max_new_tokens=16, seed=11),
        "top-p 0.9, top-k 40": SamplingParams(temperature=0.8, top_p=0.9, top_k=40, max_new_tokens=16, seed=12),
        "regex": SamplingParams(temperature=1.0, max_new_tokens=12, seed=13, regex="[0-9 +=*-]*"),
    }
    exact_rows, speed_rows, results = [], [], {}
    for name in args.models.split(","):
        base = resolve(name)
        root = Path(tempfile.mkdtemp(prefix=f"lora-{name}-"))
        log(f"{name}: {ADAPTERS} rank-{RANK} adapters")
        adapters = make_adapters(base, root)
        engine = TorchEngine(str(base), threads=args.threads, batch_window_s=0.05)
        for key, folder in adapters.items():
            config, tensors_file = read_folder(folder)
            engine.stage_adapter(key, config, load_file(tensors_file))
            engine.commit_adapter(key)
        tok = engine.tokenizer
        problems = TASKS.get("arith")().heldout(ADAPTERS * PROMPTS_PER_CALL)
        prompts = [tok(render_prompt(tok, q), add_special_tokens=False).input_ids for q in problems]
        per_call = [prompts[i * PROMPTS_PER_CALL : (i + 1) * PROMPTS_PER_CALL] for i in range(ADAPTERS)]
        keys = list(adapters)

        worst = {}
        merged = {
            k: TorchEngine(str(merged_folder(base, f, root / f"merged-{k}")), threads=args.threads)
            for k, f in adapters.items()
        }
        for kind, params in kinds.items():
            _, outs = together(engine, [(per_call[i], params, keys[i]) for i in range(ADAPTERS)])
            diff, same = 0.0, 0
            for i, key in enumerate(keys):
                want = merged[key].generate(per_call[i], params)
                for got, ref in zip(outs[i], want):
                    same += got.token_ids == ref.token_ids
                    n = min(len(got.logprobs), len(ref.logprobs))
                    diff = max(diff, *(abs(a - b) for a, b in zip(got.logprobs[:n], ref.logprobs[:n])), 0.0)
            worst[kind] = {"max_abs_logprob_diff": diff, "identical_rows": same / len(prompts)}
            said = "holds" if diff <= EXACT else "fails"
            exact_rows.append([name, kind, f"{diff:.1e}", f"{same}/{len(prompts)}", f"<= {EXACT:g}", said])
        del merged

        params = SamplingParams(temperature=1.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
        ratios = []
        while len(ratios) < args.rounds:
            wait_quiet()
            seeded = params.model_copy(update={"seed": len(ratios)})
            setups = {
                "mixed": [(per_call[i], seeded, keys[i]) for i in range(ADAPTERS)],
                "single": [(per_call[i], seeded, keys[0]) for i in range(ADAPTERS)],
            }
            order = ("mixed", "single") if len(ratios) % 2 == 0 else ("single", "mixed")
            rate = {}
            with CpuMeter() as m:
                for setup in order:
                    seconds, outs = together(engine, setups[setup])
                    rate[setup] = sum(len(o.token_ids) for call in outs for o in call) / seconds
            if m.foreign > 0.1:
                log(f"other processes used {m.foreign:.0%} of the cores: measuring the round again")
                continue
            ratios.append(rate["mixed"] / rate["single"])
            log(f"{name} round {len(ratios)}: mixed {rate['mixed']:.0f} tok/s, single {rate['single']:.0f} tok/s")
        mean, low, high = interval(ratios)
        said = verdict(low, high, RATIO)
        speed_rows.append([name, f"{mean:.2f}", f"{low:.2f}-{high:.2f}", f">= {RATIO}", said])
        results[name] = {
            "exactness": worst,
            "throughput": {"ratios": ratios, "geometric_mean": mean, "ci95": [low, high], "target": RATIO},
            "verdict": said,
            "rows": len(prompts),
            "new_tokens": NEW_TOKENS,
        }
    print("batched LoRA: logprobs against the merged model (float32)")
    print(table(["model", "sampling", "max |diff|", "identical rows", "target", "verdict"], exact_rows))
    print(f"batched LoRA: tokens/s of {ADAPTERS} adapters mixed over one adapter, {args.rounds} rounds")
    print(table(["model", "ratio", "95% CI", "target", "verdict"], speed_rows))
    write_json("lora_batched", {"args": vars(args), "adapters": ADAPTERS, "rank": RANK, "models": results})


if __name__ == "__main__":
    main()
