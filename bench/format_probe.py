"""How well a model does the sums in each answer format: greedy accuracy on the held-out arith problems with the
answer's opening forced (nothing, " ####", " The answer is"), in process, no service.

The demo's "right number in any format" starts from the format the model prefers (`The answer is n.`); once RL
has switched it to the rewarded `#### n`, the same figure measures the sums in that format. This shows what the
model can do in each before (and after) RL.

    .venv/bin/python bench/format_probe.py                                  # the embedded model, as built
    .venv/bin/python bench/format_probe.py --weights runs/demo/checkpoints/latest/policy.safetensors
It writes docs/data/format_probe.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import log, write_json  # noqa: E402
from rollout_farm.services.extensions.rewards import last_number  # noqa: E402
from rollout_farm.services.extensions.tasks import ArithTask  # noqa: E402
from rollout_farm.services.models import resolve_model  # noqa: E402

PREFIXES = {"none": "", "####": " ####", "The answer is": " The answer is"}


def accuracy(model, tok, problems, prefix: str, max_new_tokens: int) -> float:
    right = 0
    for p in problems:
        ids = tok(p.prompt + prefix, add_special_tokens=False, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
        right += last_number(tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)) == p.answer
    return right / len(problems)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="arith-tiny")
    ap.add_argument("--weights", help="a safetensors file of the same model (e.g. a checkpoint's policy)")
    a = ap.parse_args()
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model(a.model)
    tok, model = AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path).eval()
    if a.weights:
        model.load_state_dict(load_file(a.weights))
    task = ArithTask()
    problems = task.heldout(10_000)
    scores = {name: accuracy(model, tok, problems, prefix, task.max_new_tokens) for name, prefix in PREFIXES.items()}
    for name, score in scores.items():
        log(f"forced {name!r}: {score:.3f} on {len(problems)} held-out problems")
    write_json("format_probe", {"model": a.model, "weights": a.weights, "problems": len(problems), "accuracy": scores})


if __name__ == "__main__":
    main()
