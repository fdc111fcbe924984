"""The gsm8k reward against verl's own rule, and the registry's rules."""

import pytest

from rollout_farm.services.extensions.registry import Registry
from rollout_farm.services.extensions.rewards import REWARDS, extract_answer, gsm8k_reward

CASES = [
    ("no answer here", "42", None, 0.0),
    ("The answer is 42.", "42", None, 0.0),  # right number, wrong format
    ("#### 42", "42", "42", 1.0),
    ("first #### 7 then #### 42", "42", "42", 1.0),  # the last one counts
    ("#### 42 and later #### 7", "42", "7", 0.0),
    ("#### 1,234", "1234", "1234", 1.0),  # commas stripped
    ("#### -17", "-17", "-17", 1.0),  # negative numbers
    ("#### - 17", "-17", None, 0.0),
    ("####42", "42", None, 0.0),  # needs the space
    ("#### 3.50", "3.5", "3.50", 0.0),  # exact string match, like verl
    ("x" * 400 + "#### 5", "5", "5", 1.0),
    ("#### 5" + "x" * 400, "5", None, 0.0),  # only the last 300 characters are searched, like verl
]


@pytest.mark.parametrize("text,truth,answer,reward", CASES)
def test_gsm8k_reward(text, truth, answer, reward):
    assert extract_answer(text) == answer
    assert gsm8k_reward(text, truth) == reward


@pytest.mark.parametrize("text,truth,answer,reward", CASES)
def test_matches_verl(text, truth, answer, reward):
    from verl.utils.reward_score.gsm8k import compute_score

    assert gsm8k_reward(text, truth) == float(compute_score(text, truth))


def test_registry_rejects_duplicates_and_lists_names():
    reg: Registry = Registry("reward")
    reg.register("a")(len)
    with pytest.raises(ValueError, match="already registered"):
        reg.register("a")(len)
    with pytest.raises(KeyError, match="valid names: a"):
        reg.get("b")
    assert reg.get("os.path:basename")("/x/y") == "y"  # dotted path loads user code
    assert "gsm8k" in REWARDS.names()
