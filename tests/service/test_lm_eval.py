"""lm-eval against the service, on the repo's own tasks (rollout_farm/integrations/lm_eval: the held-out arith problems
as a generation task and as a multiple-choice task): `local-completions` with its default tokenized requests (token-id
prompts; loglikelihood through echo and prompt logprobs) and `local-chat-completions`. Each score is checked
against the service's own answer or a plain forward pass, not only for existing."""

from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def evaluate(monkeypatch):
    monkeypatch.chdir(ROOT)  # the tasks' data_files are relative to the repository root
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    tasks = TaskManager(include_path=str(ROOT / "rollout_farm" / "integrations" / "lm_eval"))

    def run(model: str, model_args: str, names: list[str], **kw) -> dict:
        return simple_evaluate(
            model=model, model_args=model_args, tasks=names, task_manager=tasks, log_samples=True, limit=6, **kw
        )

    return run


def loglikelihood(model_dir: Path, context: str, continuation: str) -> float:
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ctx, cont = tok(context).input_ids, tok(continuation).input_ids
    ids = torch.tensor([ctx + cont])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
    return logp[len(ctx) - 1 :].gather(-1, torch.tensor(cont)[:, None]).sum().item()


def test_lm_eval_local_completions_scores_generation_and_multiple_choice(evaluate, service, tiny_model, fresh_weights):
    args = f"base_url={service}/v1/completions,model=tiny,tokenizer={tiny_model},tokenized_requests=True,max_retries=1"
    out = evaluate("local-completions", args, ["farm_arith_gen", "farm_arith_mc"])
    assert 0.0 <= out["results"]["farm_arith_gen"]["exact_match,after_hashes"] <= 1.0
    assert 0.0 <= out["results"]["farm_arith_mc"]["acc,none"] <= 1.0
    mc = out["samples"]["farm_arith_mc"][0]
    doc = mc["doc"]
    for choice, (ll, _) in zip(doc["choices"], [r[0] for r in mc["resps"]]):
        assert ll == pytest.approx(loglikelihood(tiny_model, doc["question"] + " ####", " " + choice), abs=1e-3)
    gen = out["samples"]["farm_arith_gen"][0]
    same = httpx.post(
        f"{service}/v1/completions",
        json={"prompt": gen["doc"]["question"], "max_tokens": 16, "temperature": 0, "stop": ["\n"]},
        timeout=60,
    ).json()
    assert gen["resps"][0][0] == same["choices"][0]["text"]


def test_lm_eval_local_chat_completions_scores_generation(evaluate, service):
    args = f"base_url={service}/v1/chat/completions,model=tiny,max_retries=1"
    out = evaluate("local-chat-completions", args, ["farm_arith_gen"], apply_chat_template=True)
    assert 0.0 <= out["results"]["farm_arith_gen"]["exact_match,after_hashes"] <= 1.0
    gen = out["samples"]["farm_arith_gen"][0]
    same = httpx.post(
        f"{service}/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": gen["doc"]["question"]}],
            "max_completion_tokens": 16,
            "temperature": 0,
            "stop": ["\n"],
        },
        timeout=60,
    ).json()
    assert gen["resps"][0][0] == same["choices"][0]["message"]["content"]
