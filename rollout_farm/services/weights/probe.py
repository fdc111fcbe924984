"""The probe: checksums prove the bytes, a probe proves the engine.

An engine can receive the right bytes and still serve another policy (a stale tied embedding after a reload, a
base row in a LoRA batch computed wrong). So a push, of base weights or of an adapter, may carry a probe: a few token
sequences and the logprobs the pusher computed for them with the policy it pushes. Every replica scores the probe on
the staged policy before the commit; a difference beyond the tolerance on any replica refuses the push everywhere,
naming the replica and the error.

    {"sequences": [[ids...], ...], "logprobs": [[null, lp1, lp2, ...], ...], "tolerance": 1e-3}

`logprobs[i][j]` is log p(sequences[i][j] | sequences[i][:j]) at temperature 1 (null for j = 0, as the farm's prompt
logprobs). A pusher makes one with rollout_farm/services/weights/pusher.py's `compute_probe` (the trainer's model, or
peft's with the adapter). It travels in the first safetensors `__metadata__` of an upload under "probe" (a weight
upload's first bucket, an adapter upload's file), and in the body's `probe` of a push by path (a base push by path
may carry it as `probe.json` in its folder instead). `check` is what a replica runs; `score_staged` scores staged
base weights.
"""

from __future__ import annotations

import math
import pathlib

from pydantic import BaseModel, Field, ValidationError, model_validator

from rollout_farm.services.errors import Invalid, pydantic_fields

META_KEY, PATH_FILE = "probe", "probe.json"  # an upload's __metadata__ key; the file of a push by path
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


def in_folder(folder: pathlib.Path) -> Probe | None:
    """The probe of a base push by path: `probe.json` in its folder, if there is one (Invalid naming probe.<field>
    when it is malformed)."""
    file = folder / PATH_FILE
    if not file.is_file():
        return None
    try:
        return parse(file.read_text())
    except UnicodeDecodeError:
        raise Invalid([{"field": "probe", "message": f"{file} is not UTF-8 JSON"}]) from None


def one_of(in_body: Probe | None, in_folder: Probe | None) -> Probe | None:
    """A path push's probe: in its body or as the folder's probe.json, not both (Invalid naming `probe`)."""
    if in_body is not None and in_folder is not None:
        raise Invalid([{"field": "probe", "message": f"the folder has a {PATH_FILE} too: give one probe"}])
    return in_body or in_folder


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
    for i, want in enumerate(probe.logprobs):
        got = scored[i] if i < len(scored) else []
        for j, a in enumerate(want):
            b = got[j] if j < len(got) else None
            if a is None:
                continue
            # a token the engine did not score, or scored NaN or inf, differs without bound
            gap = abs(a - b) if b is not None and math.isfinite(b) else math.inf
            if gap > worst:
                worst, at = gap, (i, j)
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
            "everywhere (are the pushed weights the ones the logprobs came from, on the served base?)",
        )


def score_staged(model, staged: dict, sequences: list[list[int]]) -> list[list[float | None]]:
    """Each sequence's logprobs (None first) under `staged` (canonical name -> tensor, on the model's device): the
    model's own forward pass with the staged tensors in place of its parameters (torch.func.functional_call; tied
    parameters follow the one staged, as a commit's copy into them does). The module's parameters are swapped for
    the call and restored after it: the caller holds the lock that keeps every other forward pass of `model` out."""
    import torch

    device = next(iter(staged.values())).device if staged else next(model.parameters()).device
    out = []
    with torch.no_grad():
        for ids in sequences:
            x = torch.tensor([ids], dtype=torch.long, device=device)
            logits = torch.func.functional_call(model, staged, (), {"input_ids": x}, tie_weights=True, strict=False)
            logp = torch.log_softmax(logits.logits[0, :-1].float(), -1)
            out.append([None, *logp.gather(-1, x[0, 1:, None]).squeeze(-1).tolist()])
    return out
