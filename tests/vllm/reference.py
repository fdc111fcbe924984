"""The plain forward pass the vLLM tests compare with: transformers, float32, in the farm's environment."""

import torch


def forward_logprobs(model, ids: list[int]) -> list[float]:
    """log p(ids[j] | ids[:j]) for j >= 1 under `model` (a transformers causal LM)."""
    t = torch.tensor([ids])
    with torch.no_grad():
        logits = model(input_ids=t).logits.float()[0, :-1]
    return torch.log_softmax(logits, -1).gather(1, t[0, 1:, None])[:, 0].tolist()


def load(folder, tensors: dict | None = None):
    """The model of `folder`, with `tensors` in place of its weights when given."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    if tensors is not None:
        model.load_state_dict(tensors, strict=False)
        model.tie_weights()
    return model.eval()


def worst(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b), (len(a), len(b))
    return max(abs(x - y) for x, y in zip(a, b))
