"""A user's plug-ins, as a real deployment would ship them: the test services import this module through
FARM_PLUGINS; requests name the sampler by its dotted path `tests.farm_plugins:LongestOfTwo`, and the bench
app runs the engine `tests.farm_plugins:EchoEngine`."""

import zlib

from services.engine.bench_engine import BenchEngine
from services.rewards import REWARDS
from services.samplers import Sampler


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
    that every sample repeats its prompt's last token, so a test can tell that this engine generated it."""

    def generate(self, prompts, params, cancel=None):
        outs = super().generate(prompts, params, cancel)
        for prompt, out in zip(prompts, outs):
            out.token_ids = [prompt[-1]] * len(out.token_ids)
        return outs
