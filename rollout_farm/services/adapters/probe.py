"""The probe: checksums prove the bytes, a probe proves the engine.

An engine can receive the right bytes and still serve another policy (a stale tied embedding after a reload, a
base row in a LoRA batch computed wrong). So a push may carry a probe: a few token sequences and the logprobs the
pusher computed for them with the policy it pushes. Every replica scores the probe on the staged policy before the
commit; a difference beyond the tolerance on any replica refuses the push everywhere, naming the replica and the
error.

    {"sequences": [[ids...], ...], "logprobs": [[null, lp1, lp2, ...], ...], "tolerance": 1e-3}

`logprobs[i][j]` is log p(sequences[i][j] | sequences[i][:j]) at temperature 1 (null for j = 0, as the farm's prompt
logprobs). `compute` makes one from a torch model (the trainer's, or peft's with the adapter); `check` is what a
replica runs.
"""

from __future__ import annotations

import math

from pydantic import BaseModel, Field, ValidationError, model_validator

from rollout_farm.services.errors import Invalid, pydantic_fields

MAX_SEQUENCES, MAX_TOKENS = 16, 2048
DEFAULT_TOLERANCE = 1e-3  # float32 on CPU agrees to ~1e-5; bf16 on a GPU to ~1e-2: a pusher sets its own


class Probe(BaseModel):
    sequences: list[list[int]] = Field(..., min_length=1, max_length=MAX_SEQUENCES)
    logprobs: list[list[float | None]] = Field(..., min_length=1, max_length=MAX_SEQUENCES)
    tolerance: float = Field(DEFAULT_TOLERANCE, gt=0, le=10)

    @model_validator(mode="after")
    def _shapes(self) -> Probe:
        if len(self.sequences) != len(self.logprobs):
            raise ValueError(f"{len(self.sequences)} sequences but {len(self.logprobs)} lists of logprobs")
        for i, (ids, lps) in enumerate(zip(self.sequences, self.logprobs)):
            if not 2 <= len(ids) <= MAX_TOKENS or len(lps) != len(ids):
                raise ValueError(f"sequence {i}: give 2..{MAX_TOKENS} token ids and one logprob (or null) per id")
            if any(t < 0 for t in ids) or any(x is not None and not math.isfinite(x) for x in lps):
                raise ValueError(f"sequence {i}: token ids are non-negative and logprobs finite")
        return self


def parse(raw: str | dict | None) -> Probe | None:
    """The probe of a push (JSON or its object), or None; Invalid naming `probe.<field>` when it is malformed."""
    if raw is None:
        return None
    try:
        return Probe.model_validate_json(raw) if isinstance(raw, str) else Probe.model_validate(raw)
    except ValidationError as e:
        raise Invalid(pydantic_fields(e.errors(), "probe"), "the push's probe is malformed: fix the named fields")


def compute(model, sequences: list[list[int]], tolerance: float = DEFAULT_TOLERANCE) -> dict:
    """A probe for `sequences` from a torch causal LM as it is now (with its adapter, for a peft model)."""
    import torch

    logprobs = []
    with torch.no_grad():
        for ids in sequences:
            x = torch.tensor([ids], device=next(model.parameters()).device)
            logp = torch.log_softmax(model(input_ids=x).logits[0, :-1].float(), -1)
            logprobs.append([None, *logp.gather(-1, x[0, 1:, None]).squeeze(-1).tolist()])
    return {"sequences": sequences, "logprobs": logprobs, "tolerance": tolerance}


def in_vocabulary(probe: Probe, vocab_size: int) -> None:
    """Invalid naming `probe.sequences` for a token id the model has no embedding for (on a GPU, an out-of-range
    id would be a device-side assert that breaks the replica for everyone)."""
    for i, ids in enumerate(probe.sequences):
        if bad := [t for t in ids if t >= vocab_size][:3]:
            raise Invalid(
                [
                    {
                        "field": f"probe.sequences.{i}",
                        "message": f"token ids {bad} are not below the vocabulary ({vocab_size})",
                    }
                ]
            )


def check(probe: Probe, scored: list[list[float | None]], replica: str) -> None:
    """The engine's logprobs for the probe's sequences against the pusher's; Invalid naming the replica and the
    largest difference when it is beyond the tolerance."""
    worst, at = 0.0, (0, 0)
    for i, (want, got) in enumerate(zip(probe.logprobs, scored)):
        for j, (a, b) in enumerate(zip(want, got)):
            if a is not None and b is not None and abs(a - b) > worst:
                worst, at = abs(a - b), (i, j)
    if worst > probe.tolerance:
        raise Invalid(
            [
                {
                    "field": "probe",
                    "message": f"replica {replica}: logprob differs by {worst:.3g} at sequence {at[0]}, token {at[1]} "
                    f"(tolerance {probe.tolerance:g})",
                }
            ],
            "the staged policy does not compute the probe's logprobs on every replica: the push is refused "
            "everywhere (is the pushed adapter the one the logprobs came from, on the served base?)",
        )
