"""The engine boundary, shaped after SGLang's lifecycle verbs.

generate        token ids in; token ids, raw-model logprobs, per-token weight versions and a finish reason out
stage_weights   check a state dict against the model and hold it, next to the served weights
commit_weights  serve the staged weights as the new version; `policy` says what happens to in-flight samples:
                  finish   they end on the old weights; the commit waits for them
                  abort    they end with finish_reason "abort" at their next token (the caller retries them)
                  partial  they go on with the new weights from their next token (see token_versions)
discard_weights drop what was staged (another replica refused it)
pause / resume  stop and restart admitting new generate calls
abort           end every in-flight generate call at its next token ("abort")
health          prove the engine can generate one token
"""

from __future__ import annotations

import abc
import threading
from dataclasses import dataclass, field
from typing import Literal

import torch

from services.protocol import FinishReason, SamplingParams


class WeightsRejected(ValueError):
    """A weight update that does not match the model; the engine keeps its old version."""


@dataclass
class EngineOutput:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    weight_version: int  # the version of the first token (the oldest one)
    token_versions: list[int] = field(default_factory=list)  # one per token; differ only under the "partial" policy
    sampling_logprobs: list[float] | None = None  # per token, under the distribution sampled from (temperature, top-k/p); None: unknown


InFlightPolicy = Literal["finish", "abort", "partial"]


class Engine(abc.ABC):
    weight_version: int = 0

    @abc.abstractmethod
    def generate(self, prompts: list[list[int]], params: SamplingParams, cancel: threading.Event | None = None) -> list[EngineOutput]:
        """One output per prompt, in order. Logprobs are of the raw model (temperature 1, no top-p/k).
        Setting `cancel` ends the call at its next token, with finish_reason "abort"."""

    @abc.abstractmethod
    def weight_spec(self) -> dict[str, tuple[list[int], str]]:
        """The tensors an update must carry: name -> (shape, safetensors dtype)."""

    @abc.abstractmethod
    def stage_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Check and hold `state_dict` as `version`, or raise WeightsRejected; the served weights do not change."""

    @abc.abstractmethod
    def commit_weights(self, version: int, policy: InFlightPolicy | None = "finish") -> None:
        """Serve the weights staged as `version`; a no-op when it is served already. With policy None (a
        replica catching up) a commit of the same version already under way keeps its policy."""

    @abc.abstractmethod
    def discard_weights(self, version: int) -> None:
        """Drop the weights staged as `version`, if any."""

    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int, policy: InFlightPolicy = "finish") -> None:
        """Stage and commit in one go (one replica, no one to agree with)."""
        self.stage_weights(state_dict, version)
        self.commit_weights(version, policy)

    @abc.abstractmethod
    def pause(self) -> None: ...

    @abc.abstractmethod
    def resume(self) -> None: ...

    @abc.abstractmethod
    def abort(self) -> None: ...

    def health(self) -> int:
        """Generate one greedy token from a one-token prompt and return it."""
        out = self.generate([[self.health_token_id()]], SamplingParams(temperature=0.0, max_new_tokens=1))
        return out[0].token_ids[0]

    @abc.abstractmethod
    def health_token_id(self) -> int: ...
