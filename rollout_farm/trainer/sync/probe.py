"""The probe every push of the trainer carries: a few token sequences and the logprobs the trainer's own model (in
float32, in eval mode) gives them, which every farm replica scores on the staged policy before the commit
(rollout_farm/services/weights/probe.py; docs/tenants.md "A probe proves the engine").

Checksums prove that the farm received the bytes; the probe proves that its engine computes with them (an engine that
reloads weights and leaves a tied embedding stale serves another policy with the right bytes). A farm that refuses a
push for its probe stops the run (ProbeRefused, naming the replica, the sequence and the token): training on samples
from an engine that does not compute the pushed policy would be silent off-policy training.

The sequences are drawn once per run, deterministically from trainer.seed: trainer.push_probe_sequences sequences of
trainer.push_probe_tokens token ids, uniform over the vocabulary the tokenizer and the model share. 0 sequences: no
probe. The tolerance is trainer.push_probe_tolerance: float32 on a CPU agrees to about 1e-5; raise it for a farm that
serves the base in bfloat16 (LoRA training), e.g. 0.1.
"""

from __future__ import annotations

import logging
import random

import torch

from rollout_farm.services.client import FarmError
from rollout_farm.services.weights.pusher import compute_probe

SEED_SALT = 0x9E3779B1  # the probe's draws stay apart from the run's other draws of trainer.seed
log = logging.getLogger("farm.trainer")


class ProbeRefused(RuntimeError):
    """The farm refused a push because a replica's staged policy does not compute the probe's logprobs."""


class PushProbe:
    """The run's probe sequences, and the probe of a model as it is now."""

    def __init__(self, sequences: int, tokens: int, tolerance: float, vocab: int, seed: int):
        rng = random.Random(seed ^ SEED_SALT)
        self.sequences = [[rng.randrange(vocab) for _ in range(tokens)] for _ in range(sequences)]
        self.tolerance = tolerance
        self.unscorable = False  # the farm's engine cannot score a probe (SGLang): the run pushes without one

    @classmethod
    def of_run(cls, trainer_config, tokenizer, model: torch.nn.Module) -> PushProbe | None:
        """The probe trainer.push_probe_* describe for this model and tokenizer; None when push_probe_sequences is 0."""
        t = trainer_config
        if t.push_probe_sequences == 0:
            return None
        vocab = min(len(tokenizer), model.config.vocab_size)
        return cls(t.push_probe_sequences, t.push_probe_tokens, t.push_probe_tolerance, vocab, t.seed)

    def of(self, model: torch.nn.Module) -> dict | None:
        """The probe of `model` as it is now (a peft model: with its adapter), in float32; None once the farm has
        said it cannot score one."""
        return None if self.unscorable else compute_probe(model, self.sequences, self.tolerance)

    def cannot_score(self, e: FarmError) -> bool:
        """Whether `e` is the farm's 501 for a probe its engine cannot score (SGLang scores no staged policy): then
        the push goes again without one, and so do the run's later pushes (said once, as a warning)."""
        if e.status != 501 or self.unscorable:
            return False
        self.unscorable = True
        log.warning("push_probe_unsupported", extra={"farm": str(e.body)[:300], "then": "pushing without a probe"})
        return True


def probe_refused(e: FarmError) -> bool:
    """A 422 on field `probe`: a replica's staged policy did not compute the probe's logprobs."""
    body = e.body if isinstance(e.body, dict) else {}
    return e.status == 422 and any(str(d.get("field", "")).startswith("probe") for d in body.get("detail") or [])


def stop_if_probe_refused(e: FarmError, what: str) -> None:
    """ProbeRefused, naming what the farm said, when `e` refuses the push `what` for its probe."""
    if not probe_refused(e):
        return
    said = "; ".join(d.get("message", "") for d in e.body.get("detail") or [])
    raise ProbeRefused(
        f"the farm refused {what}: its engine does not compute the pushed policy ({said}). The run stops rather than "
        "train on samples of another policy. Check that the farm serves the trainer's model "
        "(actor_rollout_ref.model.path) in the dtype the tolerance allows (trainer.push_probe_tolerance; bfloat16 "
        "needs about 0.1), or push without a probe (trainer.push_probe_sequences=0)"
    ) from e
