"""GSM8K pass@1 (greedy, test split) of a model, through the real service: the trainer's own evaluation.

    .venv/bin/pip install gguf                                   # once, to build smollm2 from its GGUF
    .venv/bin/python bench/gsm8k_eval.py --model smollm2          # the full test split (1319 problems)
    .venv/bin/python bench/gsm8k_eval.py --model smollm2 --size 200

Prompts go through the model's chat template with the task's instruction (answer after "####"); the
reward is an exact match of the number after the last "####". Writes docs/data/gsm8k_<model>.json.
Each scored problem is appended to bench/results/gsm8k_<model>_progress.jsonl, so a stopped run goes on
where it stopped. The full split takes about an hour and a quarter on 2 CPU cores (SmolLM2 writes up
to 512 tokens; finished answers leave the engine batch, which took 5.5 hours before).
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import RESULTS, TOKEN, log, resolve, start_service, stop_service, write_json  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="smollm2, arith-tiny or an HF model folder")
    ap.add_argument("--size", type=int, default=1319, help="test problems, from the first (1319: all)")
    ap.add_argument("--chunk", type=int, default=64, help="problems per request (one engine batch)")
    a = ap.parse_args()
    from tqdm import tqdm
    from transformers import AutoTokenizer

    from rollout_farm.services.client import FarmClient
    from rollout_farm.services.extensions.tasks import TASKS
    from rollout_farm.trainer.evaluate import Accuracy, score
    from rollout_farm.trainer.sync.rollouts import render_prompt

    path = resolve(a.model)
    tok, task = AutoTokenizer.from_pretrained(path), TASKS.get("gsm8k")()
    render = partial(render_prompt, tok)  # the trainer's prompts: through the chat template

    RESULTS.mkdir(parents=True, exist_ok=True)
    progress = (
        RESULTS / f"gsm8k_{Path(a.model).name}_progress.jsonl"
    )  # one line per scored problem: a rerun goes on from there
    done = {}
    if progress.exists():
        done = {
            d["i"]: d
            for d in map(json.loads, progress.read_text().splitlines())
            if d.get("max_new_tokens") == task.max_new_tokens
        }
    problems = task.heldout(a.size)
    todo = [i for i in range(len(problems)) if i not in done]
    log(f"{len(done)} of {len(problems)} problems scored already; {len(todo)} to go")
    if todo:
        url = start_service(model=str(path), replicas=1)
        try:
            with (
                FarmClient(url, TOKEN, timeout=3600) as client,
                progress.open("a") as f,
            ):  # a chunk of long greedy answers takes minutes
                chunks = score(client, task, render, [problems[i] for i in todo], a.chunk)
                for k, part in enumerate(tqdm(chunks, desc="evaluating", unit="chunk", total=-(-len(todo) // a.chunk))):
                    for i, row in zip(todo[k * a.chunk : (k + 1) * a.chunk], part):
                        done[i] = {"i": i, **row, "max_new_tokens": task.max_new_tokens}
                        f.write(json.dumps(done[i]) + "\n")
                    f.flush()
        finally:
            stop_service()
    rows = [done[i] for i in range(len(problems))]
    acc = Accuracy([r["correct"] for r in rows], [r["number"] for r in rows])
    lo, hi = acc.wilson()
    print(
        f"\nGSM8K test pass@1 (greedy), {a.model}, {acc.n} problems: {acc.value:.3f} (95% CI {lo:.3f}-{hi:.3f}); "
        f"right number in any format: {acc.as_dict()['number_accuracy']:.3f}; "
        f"mean response {sum(r['tokens'] for r in rows) / len(rows):.0f} tokens"
    )
    write_json(
        f"gsm8k_{Path(a.model).name}",
        {
            "model": a.model,
            "size": acc.n,
            "accuracy": acc.value,
            "ci95": [lo, hi],
            "number_accuracy": acc.as_dict()["number_accuracy"],
            "max_new_tokens": task.max_new_tokens,
        },
    )
    log("done")


if __name__ == "__main__":
    main()
