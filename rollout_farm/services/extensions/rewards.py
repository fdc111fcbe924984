"""Reward functions, registered by name. Each maps (response text, ground truth) to a float."""

from __future__ import annotations

import re
from typing import Callable

from rollout_farm.services.extensions.registry import Registry

RewardFn = Callable[[str, "str | None"], float]
REWARDS: Registry[RewardFn] = Registry("reward")

_ANSWER = re.compile(r"#### (\-?[0-9\.\,]+)")
_INTEGER = re.compile(r"-?\d+")
_CLIP_CHARS = 300  # verl matches only the last 300 characters


def extract_answer(text: str) -> str | None:
    """The last `#### <number>` in text, with ',' and '$' removed; verl's 'strict' gsm8k rule."""
    found = _ANSWER.findall(text[-_CLIP_CHARS:])
    return found[-1].replace(",", "").replace("$", "") if found else None


@REWARDS.register("gsm8k")
def gsm8k_reward(text: str, ground_truth: str | None) -> float:
    """1.0 when the last `#### <number>` equals the ground truth exactly, else 0.0."""
    answer = extract_answer(text)
    return 1.0 if answer is not None and answer == ground_truth else 0.0


def integers(text: str) -> list[str]:
    """The integers in text, in order, with ',' removed (so 1,234 is one)."""
    return _INTEGER.findall(text.replace(",", ""))


def last_number(text: str) -> str | None:
    """The last integer in text, whatever the format around it."""
    found = integers(text)
    return found[-1] if found else None


@REWARDS.register("last_number")
def last_number_reward(text: str, ground_truth: str | None) -> float:
    """1.0 when the last integer in the text equals the ground truth: a grade that no format earns."""
    answer = last_number(text)
    return 1.0 if answer is not None and answer == ground_truth else 0.0


@REWARDS.register("zero")
def zero_reward(text: str, ground_truth: str | None) -> float:
    """Always 0.0: for requests that only need trajectories."""
    return 0.0
