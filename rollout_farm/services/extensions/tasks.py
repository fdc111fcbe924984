"""Prompt sources with reference answers: a fast arithmetic task, products for the calculator environment, GSM8K,
and two-digit addition asked in words for a small pretrained chat model.

All but `addition` use the GSM8K answer format (`#### <number>`) and so the `gsm8k` reward; `addition` is graded on
the last number of the answer, whatever its format (the `last_number` reward).
"""

from __future__ import annotations

import json
import random
import zlib
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from rollout_farm.services.extensions.registry import Registry

DATA = Path(__file__).parent / "data"


@dataclass(frozen=True)
class Problem:
    prompt: str  # what the model sees (before any chat template)
    answer: str  # the reference answer, compared exactly with the model's `#### <number>`


class Task:
    name: str
    reward = "gsm8k"
    max_new_tokens = 256

    def train_batch(self, rng: random.Random, k: int) -> list[Problem]:
        raise NotImplementedError

    def heldout(self, n: int) -> list[Problem]:
        raise NotImplementedError


TASKS: Registry[type[Task]] = Registry("task")


@TASKS.register("arith")
class ArithTask(Task):
    """Two-digit addition and subtraction, `Q: 37+48\\nA:`. One fifth of all problems is held out."""

    name = "arith"
    max_new_tokens = 24

    @staticmethod
    def problem(a: int, op: str, b: int) -> Problem:
        return Problem(prompt=f"Q: {a}{op}{b}\nA:", answer=str(a + b if op == "+" else a - b))

    @staticmethod
    def is_heldout(a: int, op: str, b: int) -> bool:
        return zlib.crc32(f"{a}{op}{b}".encode()) % 5 == 0

    def _split(self, heldout: bool) -> list[tuple[int, str, int]]:
        triples = [(a, op, b) for a in range(100) for op in "+-" for b in range(10) if op == "+" or a >= b]
        return [t for t in triples if self.is_heldout(*t) == heldout]

    @cached_property
    def train_split(self) -> list[tuple[int, str, int]]:
        return self._split(heldout=False)

    def train_batch(self, rng: random.Random, k: int) -> list[Problem]:
        return [self.problem(*rng.choice(self.train_split)) for _ in range(k)]

    def heldout(self, n: int) -> list[Problem]:
        triples = self._split(heldout=True)
        random.Random(0).shuffle(triples)
        return [self.problem(*t) for t in triples[:n]]


@TASKS.register("products")
class ProductsTask(Task):
    """Products of a 3-digit and a 3- to 4-digit number, `Q: 347*2918\nA:`: beyond what the embedded model can
    work out in its head, within reach with the calculator environment (bench/episodes.py). One fifth is held out."""

    name = "products"
    max_new_tokens = 48  # a turn: a calculator call, or the answer

    @staticmethod
    def problem(a: int, b: int) -> Problem:
        return Problem(prompt=f"Q: {a}*{b}\nA:", answer=str(a * b))

    @staticmethod
    def is_heldout(a: int, b: int) -> bool:
        return zlib.crc32(f"{a}*{b}".encode()) % 5 == 0

    @staticmethod
    def draw(rng: random.Random, heldout: bool) -> tuple[int, int]:
        while True:
            a, b = rng.randint(100, 999), rng.randint(100, 9999)
            if ProductsTask.is_heldout(a, b) == heldout:
                return a, b

    def train_batch(self, rng: random.Random, k: int) -> list[Problem]:
        return [self.problem(*self.draw(rng, heldout=False)) for _ in range(k)]

    def heldout(self, n: int) -> list[Problem]:
        rng, pairs = random.Random(0), {}
        while len(pairs) < n:
            pairs.setdefault(self.draw(rng, heldout=True), None)
        return [self.problem(*pair) for pair in pairs]


@TASKS.register("addition")
class AdditionTask(Task):
    """Two two-digit numbers, `What is 47 + 38? Answer with the number only.`, for a pretrained chat model
    (bench/real_model.py): SmolLM2-135M gets about a tenth right greedily, often in sentences of its own. Graded on
    the last number of the answer, so that a gain is in the sums, not in a format. One fifth of the 8,100 pairs is
    held out."""

    name = "addition"
    reward = "last_number"
    max_new_tokens = 48

    @staticmethod
    def problem(a: int, b: int) -> Problem:
        return Problem(prompt=f"What is {a} + {b}? Answer with the number only.", answer=str(a + b))

    @staticmethod
    def is_heldout(a: int, b: int) -> bool:
        return zlib.crc32(f"{a}+{b}".encode()) % 5 == 0

    def _split(self, heldout: bool) -> list[tuple[int, int]]:
        return [(a, b) for a in range(10, 100) for b in range(10, 100) if self.is_heldout(a, b) == heldout]

    @cached_property
    def train_split(self) -> list[tuple[int, int]]:
        return self._split(heldout=False)

    def train_batch(self, rng: random.Random, k: int) -> list[Problem]:
        return [self.problem(*rng.choice(self.train_split)) for _ in range(k)]

    def heldout(self, n: int) -> list[Problem]:
        pairs = self._split(heldout=True)
        random.Random(0).shuffle(pairs)
        return [self.problem(*pair) for pair in pairs[:n]]


@TASKS.register("gsm8k")
class GSM8KTask(Task):
    """Grade-school math (MIT licence, rollout_farm/services/data/gsm8k). Held-out problems come from the test split."""

    name = "gsm8k"
    max_new_tokens = 512
    instruction = 'Let\'s think step by step and output the final answer after "####".'

    def _load(self, split: str) -> list[Problem]:
        rows = [json.loads(line) for line in (DATA / "gsm8k" / f"{split}.jsonl").open()]
        return [
            Problem(
                prompt=f"{r['question']} {self.instruction}",
                answer=r["answer"].split("####")[-1].strip().replace(",", ""),
            )
            for r in rows
        ]

    @cached_property
    def train_split(self) -> list[Problem]:
        return self._load("train")

    def train_batch(self, rng: random.Random, k: int) -> list[Problem]:
        return rng.sample(self.train_split, k)

    def heldout(self, n: int) -> list[Problem]:
        return self._load("test")[:n]
