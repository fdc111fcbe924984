"""The engine boundary, shaped after SGLang's lifecycle verbs.

generate        token ids in; token ids, raw-model logprobs and a finish reason out
update_weights  load a safetensors state dict as a new, higher version
pause / resume  stop and restart admitting new generate calls
abort           end every in-flight generate call at its next token ("abort")
health          prove the engine can generate one token
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

import torch

from services.protocol import FinishReason, SamplingParams


class WeightsRejected(ValueError):
    """A weight update that does not match the model; the engine keeps its old version."""


@dataclass
class EngineOutput:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    weight_version: int


class Engine(abc.ABC):
    weight_version: int = 0

    @abc.abstractmethod
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[EngineOutput]:
        """One output per prompt, in order. Logprobs are of the raw model (temperature 1, no top-p/k)."""

    @abc.abstractmethod
    def weight_spec(self) -> dict[str, tuple[list[int], str]]:
        """The tensors an update must carry: name -> (shape, safetensors dtype)."""

    @abc.abstractmethod
    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Replace the weights and set the version, or raise WeightsRejected and change nothing."""

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
