"""Held-out accuracy through the service (greedy, one sample per problem), with 95% intervals."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterator

from rollout_farm.services import protocol as P
from rollout_farm.services.client import FarmClient
from rollout_farm.services.extensions.rewards import last_number
from rollout_farm.services.extensions.tasks import Problem, Task

Z95 = 1.959964


@dataclass
class Accuracy:
    correct: list[bool]  # reward > 0.5, one per held-out problem, in a fixed order
    number_correct: list[bool] | None = None  # the last number in the output is right, whatever the format

    @property
    def n(self) -> int:
        return len(self.correct)

    @property
    def value(self) -> float:
        return sum(self.correct) / max(1, self.n)

    def wilson(self) -> tuple[float, float]:
        """95% Wilson score interval of the accuracy."""
        return wilson(sum(self.correct), self.n)

    def as_dict(self) -> dict:
        out = {"accuracy": self.value, "n": self.n, "ci95": list(self.wilson()), "correct": self.correct}
        if self.number_correct is not None:
            out["number_accuracy"] = sum(self.number_correct) / max(1, self.n)
            out["number_ci95"] = list(wilson(sum(self.number_correct), self.n))
            out["number_correct"] = self.number_correct
        return out


def wilson(successes: int, n: int) -> tuple[float, float]:
    """95% Wilson score interval of a proportion."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    centre = (p + Z95**2 / (2 * n)) / (1 + Z95**2 / n)
    half = Z95 * math.sqrt(p * (1 - p) / n + Z95**2 / (4 * n * n)) / (1 + Z95**2 / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def paired_gain(before: list[bool], after: list[bool]) -> tuple[float, float]:
    """Gain in accuracy on the same problems and the half-width of its 95% interval (paired normal approximation)."""
    n = len(before)
    d = [int(a) - int(b) for a, b in zip(after, before)]
    mean = sum(d) / n
    var = sum((x - mean) ** 2 for x in d) / max(1, n - 1)
    return mean, Z95 * math.sqrt(var / n)


def score(
    client: FarmClient,
    task: Task,
    render: Callable[[Problem], str],
    problems: list[Problem],
    chunk: int = 256,
    adapter: P.AdapterRef | None = None,
) -> Iterator[list[dict]]:
    """Greedy answers through the service (from `adapter`, a LoRA adapter, when given), a chunk at a time: per
    problem, whether the reward counts it correct, whether its last number is right in any format, and its length in
    tokens."""
    params = P.SamplingParams(temperature=0.0, max_new_tokens=task.max_new_tokens)
    for i in range(0, len(problems), chunk):
        part = problems[i : i + chunk]
        req = P.RolloutRequest(
            prompts=[P.Prompt(text=render(p), ground_truth=p.answer) for p in part],
            n=1,
            sampling_params=params,
            reward=task.reward,
            adapter=adapter,
        )
        yield [
            {
                "correct": g.samples[0].reward > 0.5,
                "number": last_number(g.samples[0].text) == p.answer,
                "tokens": len(g.samples[0].token_ids),
            }
            for g, p in zip(client.rollouts(req).groups, part)
        ]


def evaluate(
    client: FarmClient,
    task: Task,
    render: Callable[[Problem], str],
    n: int,
    chunk: int = 256,
    adapter: P.AdapterRef | None = None,
) -> Accuracy:
    rows = [r for part in score(client, task, render, task.heldout(n), chunk, adapter) for r in part]
    return Accuracy([r["correct"] for r in rows], [r["number"] for r in rows])
