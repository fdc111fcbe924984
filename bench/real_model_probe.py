"""Skill or format? The real-model arm's policies (bench/real_model.py) answering the same held-out sums, greedily, in
process (no service), graded three ways: the last number (the bench's grade), the sum anywhere in the answer as a
whole number (a model that states the sum and then writes more numbers), and the answer being the number alone.

If the gain were only the model learning to stop after the sum, the "anywhere" grade would barely move: it counts a
sum followed by other numbers as right. Where "anywhere" rises too, the model gets more sums right.

    .venv/bin/python bench/real_model.py            # its runs leave runs/bench-real-model/seed<k>/checkpoints
    .venv/bin/python bench/real_model_probe.py      # the base and each seed's last policy (about 2 min each)
    .venv/bin/python bench/real_model_probe.py --report   # docs/results.md's table from the file alone
It writes docs/data/real_model/probe.json, with every answer.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import ROOT, log, provenance, smollm2  # noqa: E402
from rollout_farm.services.extensions.rewards import integers, last_number  # noqa: E402
from rollout_farm.services.extensions.tasks import AdditionTask  # noqa: E402
from rollout_farm.trainer.sync.rollouts import render_prompt  # noqa: E402

OUT = ROOT / "docs" / "data" / "real_model" / "probe.json"
RUNS = ROOT / "runs" / "bench-real-model"


def grades(text: str, answer: str) -> dict:
    numbers = integers(text)
    return {
        "last": last_number(text) == answer,
        "anywhere": answer in numbers,
        "alone": text.strip().rstrip(".") == answer,
    }


def answers(model, tok, prompts: list[str], max_new_tokens: int, batch: int = 25) -> list[str]:
    """Greedy answers, a left-padded batch at a time."""
    tok.padding_side = "left"
    out = []
    for i in tqdm(range(0, len(prompts), batch), desc="answers", unit="batch", file=sys.stderr, leave=False):
        enc = tok(prompts[i : i + batch], add_special_tokens=False, return_tensors="pt", padding=True)
        with torch.no_grad():
            ids = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
        out += tok.batch_decode(ids[:, enc.input_ids.shape[1] :], skip_special_tokens=True)
    return out


def learning_rate(weights: Path) -> float:
    """The run's learning rate, from the checkpoint's state beside the weights."""
    config = json.loads((weights.parent / "state.json").read_text())["config"]
    return config["actor_rollout_ref"]["actor"]["optim"]["lr"]


def probe(policies: dict[str, Path | None], n: int) -> dict:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = smollm2()
    tok = AutoTokenizer.from_pretrained(path)
    tok.pad_token = tok.pad_token or tok.eos_token
    task = AdditionTask()
    problems = task.heldout(n)
    prompts = [render_prompt(tok, p) for p in problems]
    rows = {}
    for name, weights in policies.items():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        if weights:
            missing, unexpected = model.load_state_dict(load_file(weights), strict=False)
            if unexpected or set(missing) - {"lm_head.weight"}:  # lm_head is tied to the embeddings, not saved
                sys.exit(f"{weights} does not fit the model: missing {missing}, unexpected {unexpected}")
            model.tie_weights()
        texts = answers(model, tok, prompts, task.max_new_tokens)
        rows[name] = [{"text": t, **grades(t, p.answer)} for t, p in zip(texts, problems)]
        share = {k: sum(r[k] for r in rows[name]) / n for k in ("last", "anywhere", "alone")}
        log(f"{name}: {share}")
    return {
        "problems": [p.prompt for p in problems],
        "policies": {k: str(v.relative_to(ROOT)) if v else "base" for k, v in policies.items()},
        "lr": sorted({learning_rate(v) for v in policies.values() if v}),
        **provenance(),
        "answers": rows,
    }


def report(data: dict, service: dict[str, str] | None = None) -> str:
    """A markdown table: per policy, the share right by each grade, the mean count of numbers in an answer, and on
    how many problems its last-number grade is the one the service gave in the training run (`service`: per policy,
    the run's grades as "0"/"1"), which shows these are the same policies and the same greedy answers."""
    service = service or {}
    lines = [
        "| policy | last number right | sum anywhere | the number alone | numbers an answer | same grade as the run |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, answered in data["answers"].items():
        n = len(answered)
        numbers = sum(len(integers(a["text"])) for a in answered) / n
        shares = " | ".join(f"{sum(a[k] for a in answered) / n:.3f}" for k in ("last", "anywhere", "alone"))
        mine = "".join("1" if a["last"] else "0" for a in answered)
        theirs = service.get(name)
        same = f"{sum(a == b for a, b in zip(mine, theirs))}/{n}" if theirs and len(theirs) == n else "no run file"
        lines.append(f"| {name} | {shares} | {numbers:.1f} | {same} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--eval-size", type=int, default=200)
    ap.add_argument("--report", action="store_true", help="print the table (real_model.py --report puts it in docs)")
    a = ap.parse_args()
    if not a.report:
        policies: dict[str, Path | None] = {"base": None}
        for seed in range(a.seeds):
            folder = RUNS / f"seed{seed}" / "checkpoints"
            weights = folder / (folder / "latest").read_text().strip() / "policy.safetensors"
            if not weights.exists() or not (folder / "latest").exists():
                sys.exit(f"{weights} is missing: run bench/real_model.py first")
            policies[f"seed {seed}"] = weights
        OUT.write_text(json.dumps(probe(policies, a.eval_size), indent=1) + "\n")
        log(f"wrote {OUT.relative_to(ROOT)}")
    print(report(json.loads(OUT.read_text())))


if __name__ == "__main__":
    main()
