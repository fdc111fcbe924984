"""A user's plug-ins, as a real deployment would ship them: the test services import this module through
FARM_PLUGINS; requests name the sampler by its dotted path `tests.farm_plugins:LongestOfTwo`, and the bench
app runs the engine `tests.farm_plugins:EchoEngine`."""

import asyncio
import re
import zlib
from typing import Literal

from pydantic import BaseModel, ConfigDict

from rollout_farm.services.chat.tool_formats import TOOL_FORMATS, Hermes
from rollout_farm.services.engine.bench_engine import BenchEngine
from rollout_farm.services.episodes.environments import ENVIRONMENTS, Environment, Step
from rollout_farm.services.extensions.rewards import REWARDS
from rollout_farm.services.extensions.samplers import Sampler


class LongestOfTwo(Sampler):
    """Generates 2n candidates and keeps the n with the most tokens (ties: the earliest)."""

    def candidates(self, n: int) -> int:
        return 2 * n

    def select(self, samples, n, rng):
        kept = sorted(samples, key=lambda s: -len(s.token_ids))[:n]
        return [s.model_copy(update={"sampler_meta": {**s.sampler_meta, "picked_by": "LongestOfTwo"}}) for s in kept]


@REWARDS.register("test_float_ties")
def float_ties(text: str, ground_truth: str | None) -> float:
    """For ground truth 'tie': 0.1 + 0.2 or 0.3 by the text's parity: equal rewards that differ in the last bit,
    the case a filter comparing floats exactly gets wrong. Otherwise a value spread by a hash of the text."""
    if ground_truth == "tie":
        return 0.1 + 0.2 if len(text) % 2 else 0.3
    return zlib.crc32(text.encode()) % 1000 / 1000


class EchoEngine(BenchEngine):
    """A user engine named by dotted path (`FARM_ENGINE=tests.farm_plugins:EchoEngine`): the bench engine, except
    that every sample repeats its prompt's last token, so a test can tell that this engine generated it.

    It is also the scripted agent model of the session and episode tests (a fake for what cannot run here: no model
    small enough to train in a test writes tool calls): a prompt whose text holds `say:‹...›` is answered with the
    text between the marks of the last one, then stops, so a test scripts each turn (tool calls, malformed ones,
    answers) through the messages it sends. Its context is 8192 tokens."""

    SCRIPT = re.compile(r"say:‹(.*?)›", re.DOTALL)

    def generate(self, prompts, params, cancel=None):
        outs = super().generate(prompts, params, cancel)
        for prompt, out in zip(prompts, outs):
            scripts = self.SCRIPT.findall(self.tokenizer.decode(prompt))
            if scripts and out.token_ids:
                said = self.tokenizer.encode(scripts[-1], add_special_tokens=False)
                n = min(len(said), len(out.token_ids))
                out.token_ids, out.logprobs, out.token_versions = said[:n], out.logprobs[:n], out.token_versions[:n]
                out.sampling_logprobs = out.sampling_logprobs and out.sampling_logprobs[:n]
                out.finish_reason = "stop" if n == len(said) else out.finish_reason
            else:
                out.token_ids = [prompt[-1]] * len(out.token_ids)
        return outs

    def context_length(self) -> int:
        return 8192


@TOOL_FORMATS.register("test_wrong_tag")
class WrongTag(Hermes):
    """The hermes format with a typo in its tag (`<toolcall>`): a parser that never matches what a Qwen model writes,
    the negative control of the tool-call metrics."""

    name = "test_wrong_tag"
    BLOCK = re.compile(r"<toolcall>(.*?)</toolcall>", re.DOTALL)
    OPEN = "<toolcall>"


class FlakyParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    behaviour: Literal["raise", "hang", "hang_reset", "endless", "scored"]


@ENVIRONMENTS.register("test_flaky")
class Flaky(Environment):
    """An environment that fails as remote sandboxes do: its step raises, or hangs, or its reset hangs; or it never
    ends (every step answers "go on"); or ("scored") it answers "go on" once and ends the second turn with a reward
    spread by a hash of the episode's text (rewards that vary, for training on two-turn episodes)."""

    Params = FlakyParams
    tool_format = "plain"

    async def reset(self, prompt):
        self.turns, self.said = 0, ""
        if self.params.behaviour == "hang_reset":
            await asyncio.sleep(3600)
        return [{"role": "user", "content": prompt.text}]

    async def step(self, turn):
        if self.params.behaviour == "raise":
            raise RuntimeError("the sandbox crashed")
        if self.params.behaviour == "hang":
            await asyncio.sleep(3600)
        self.turns, self.said = self.turns + 1, self.said + turn.text
        if self.params.behaviour == "scored" and self.turns == 2:
            return Step(reward=zlib.crc32(self.said.encode()) % 1000 / 1000, done=True)
        return Step([{"role": "user", "content": "go on"}])
