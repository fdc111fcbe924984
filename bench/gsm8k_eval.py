"""GSM8K pass@1 (greedy, test split) of a model, through the real service: the trainer's own evaluation.

    .venv/bin/pip install gguf                                   # once, to build smollm2 from its GGUF
    .venv/bin/python bench/gsm8k_eval.py --model smollm2          # the full test split (1319 problems)
    .venv/bin/python bench/gsm8k_eval.py --model smollm2 --size 200

Prompts go through the model's chat template with the task's instruction (answer after "####"); the
reward is an exact match of the number after the last "####". Writes bench/results/gsm8k_<model>.json.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import TOKEN, log, resolve, start_service, stop_service, write_json  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="smollm2, arith-tiny or an HF model folder")
    ap.add_argument("--size", type=int, default=1319, help="test problems, from the first (1319: all)")
    ap.add_argument("--chunk", type=int, default=32, help="problems per request")
    a = ap.parse_args()
    from transformers import AutoTokenizer

    from services.client import FarmClient
    from services.tasks import TASKS
    from trainer.evaluate import evaluate

    path = resolve(a.model)
    tok, task = AutoTokenizer.from_pretrained(path), TASKS.get("gsm8k")()

    def render(p):
        if tok.chat_template:
            return tok.apply_chat_template([{"role": "user", "content": p.prompt}], tokenize=False, add_generation_prompt=True)
        return p.prompt

    url = start_service(model=str(path), replicas=1)
    t = time.perf_counter()
    try:
        with FarmClient(url, TOKEN) as client:
            acc = evaluate(client, task, render, a.size, chunk=a.chunk, progress=True)
    finally:
        stop_service()
    seconds = time.perf_counter() - t
    lo, hi = acc.wilson()
    print(f"\nGSM8K test pass@1 (greedy), {a.model}, {acc.n} problems: {acc.value:.3f} (95% CI {lo:.3f}-{hi:.3f}); "
          f"right number in any format: {acc.as_dict()['number_accuracy']:.3f}; {seconds:.0f} s")
    write_json(f"gsm8k_{Path(a.model).name}", {"model": a.model, "size": acc.n, "accuracy": acc.value, "ci95": [lo, hi],
                                               "number_accuracy": acc.as_dict()["number_accuracy"], "seconds": seconds,
                                               "max_new_tokens": task.max_new_tokens})
    log("done")


if __name__ == "__main__":
    main()
