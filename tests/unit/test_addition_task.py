"""The `addition` task (bench/real_model.py's skill) and the `last_number` reward it is graded with: a grade no format
earns, a held-out split the training draws never touch."""

import random

import pytest

from rollout_farm.services.extensions.rewards import REWARDS, integers
from rollout_farm.services.extensions.tasks import TASKS, AdditionTask

LAST_NUMBER = [
    ("The answer is 27 + 82 = 109.", "109", 1.0),  # a sentence of its own: the last number counts
    ("27 + 82 = 109", "109", 1.0),
    ("#### 109", "109", 1.0),  # the gsm8k format earns nothing more
    ("109, or rather 110", "109", 0.0),  # only the last number
    ("1,009", "1009", 1.0),  # commas removed
    ("The sum is -5", "-5", 1.0),
    ("I cannot add these.", "109", 0.0),
    ("", "109", 0.0),
    ("1090", "109", 0.0),  # whole numbers, not prefixes
]


@pytest.mark.parametrize("text,truth,reward", LAST_NUMBER)
def test_last_number_reward(text, truth, reward):
    assert REWARDS.get("last_number")(text, truth) == reward


def test_integers_are_whole_numbers_in_order_with_thousands_joined():
    assert integers("27 + 82 = 109, not 1,090 or -5.") == ["27", "82", "109", "1090", "-5"]
    assert integers("no digits") == []


def test_the_gsm8k_reward_would_grade_the_format():
    """Negative control: the same right sentence scores 0 under the format-bound reward the other tasks use."""
    assert REWARDS.get("gsm8k")("The answer is 27 + 82 = 109.", "109") == 0.0
    assert REWARDS.get("last_number")("The answer is 27 + 82 = 109.", "109") == 1.0


def test_the_task_is_graded_on_the_last_number():
    task = TASKS.get("addition")()
    assert task.reward == "last_number"
    p = task.heldout(1)[0]
    question = p.prompt.removeprefix("What is ").removesuffix("? Answer with the number only.")
    a, b = (int(x) for x in question.split(" + "))
    assert p.answer == str(a + b) and 10 <= a <= 99 and 10 <= b <= 99


def test_held_out_problems_are_never_drawn_for_training():
    task = AdditionTask()
    heldout = {p.prompt for p in task.heldout(10_000)}
    assert 1400 < len(heldout) < 1850  # about one fifth of 8,100 pairs
    train = {task.problem(*pair).prompt for pair in task.train_split}
    assert not train & heldout and len(train) + len(heldout) == 90 * 90  # the two splits cover every pair once
    drawn = {p.prompt for p in task.train_batch(random.Random(0), 20_000)}
    assert drawn <= train and len(drawn) > 0.9 * len(train)
    assert [p.prompt for p in task.heldout(50)] == [p.prompt for p in AdditionTask().heldout(50)]  # a fixed order
