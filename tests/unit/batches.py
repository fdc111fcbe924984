"""One builder of hand-made trainer `Batch`es (rollout_farm/trainer/batch.py) for the unit tests."""

from __future__ import annotations

import torch

from rollout_farm.trainer.batch import Batch


def response_batch(
    response_mask: torch.Tensor, response_ids: torch.Tensor | None = None, prompt_id: int = 0, **fields
) -> Batch:
    """B samples of R response tokens (`response_mask` is (B, R)) after a one-token prompt, `prompt_id`: response
    token j is predicted at position j, every position attended. `response_ids` default to 0; `fields` replace the
    defaults: rollout and sampling logprobs 0, sampling known, temperature 1, importance weight 1, reward 0, every
    sample in group 0, weight version 0."""
    B, R = response_mask.shape
    ids = torch.zeros(B, R, dtype=torch.long) if response_ids is None else response_ids
    input_ids = torch.cat([torch.full((B, 1), prompt_id, dtype=torch.long), ids], 1)
    defaults = dict(
        rollout_logprobs=torch.zeros(B, R),
        sampling_logprobs=torch.zeros(B, R),
        sampling_known=torch.ones(B, dtype=torch.long),
        temperatures=torch.ones(B),
        importance_weights=torch.ones(B),
        rewards=torch.zeros(B),
        group_ids=torch.zeros(B, dtype=torch.long),
        weight_versions=torch.zeros(B, dtype=torch.long),
    )
    return Batch(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        response_pos=torch.arange(R).repeat(B, 1),
        response_ids=ids,
        response_mask=response_mask,
        **(defaults | fields),
    )
