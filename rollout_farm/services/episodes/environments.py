"""Environments run in the farm: what an episode of POST /v1/episodes talks to, one instance per episode.

An environment is a small async interface, registered in ENVIRONMENTS (a name, or `pkg.module:Class` from a
FARM_PLUGINS module):

  Params        a pydantic model of the request's `env.params` (a typo is a 422 naming the field)
  tools         the OpenAI tool definitions the model is shown (a class's, or an instance's set by reset);
                tool_format how it writes calls (TOOL_FORMATS)
  reset(prompt)             the episode's opening messages
  step(turn)                the model's turn (text, token ids, parsed tool calls) -> Step: the observation messages
                            (tool results, a user's reply), a reward, done, info
  close()                   after the episode, whatever happened (release a sandbox, a connection)

The runner (rollout_farm/services/episodes/episodes.py) bounds every call with the request's tool timeout: a step that
does not answer in time gets an error observation and the episode goes on; an exception ends that episode (stop_reason
`env_error`, with its message), never the group or the service.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import ClassVar

from pydantic import BaseModel, ConfigDict

from rollout_farm.services import protocol as P
from rollout_farm.services.chat.tool_formats import ToolCall
from rollout_farm.services.extensions.registry import Registry


class NoParams(BaseModel):
    model_config = ConfigDict(extra="forbid")


@dataclass(frozen=True)
class AssistantTurn:
    """A sampled turn as the environment sees it."""

    text: str  # the content, without the tool calls that were read
    token_ids: list[int]
    tool_calls: list[ToolCall]
    malformed: list[str]  # why each call that did not read was refused
    finish_reason: str


@dataclass
class Step:
    observation: list[dict] = field(default_factory=list)  # chat messages to append (role tool or user)
    reward: float = 0.0
    done: bool = False
    info: dict = field(default_factory=dict)


class Environment(abc.ABC):
    Params: ClassVar[type[BaseModel]] = NoParams
    tools: ClassVar[list[dict]] = []
    tool_format: ClassVar[str] = "hermes"

    def __init__(self, params: BaseModel):
        self.params = params

    @classmethod
    def remote_urls(cls, params: BaseModel) -> dict[str, str]:
        """The URLs the environment will connect to, by their params field: each must be in FARM_ENV_ALLOWED_HOSTS
        (checked before any episode starts: a 422 naming the field; rollout_farm/services/episodes/allowed_hosts.py),
        and the connection itself goes through allowed_hosts.current()."""
        return {}

    @abc.abstractmethod
    async def reset(self, prompt: P.Prompt) -> list[dict]:
        """The episode's opening messages (a system prompt, the task)."""

    @abc.abstractmethod
    async def step(self, turn: AssistantTurn) -> Step:
        """The environment's answer to one sampled turn."""

    async def close(self) -> None:
        """Called once after the episode, however it ended."""


ENVIRONMENTS: Registry[type[Environment]] = Registry("environment", Environment)
