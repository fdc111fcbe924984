"""The products task (bench/episodes.py's): its held-out fifth never appears in training, and its answers are the
products."""

import random

from rollout_farm.services.extensions.tasks import TASKS, ProductsTask


def test_training_never_draws_a_held_out_problem_and_the_held_out_set_is_fixed():
    task = TASKS.get("products")()
    heldout = task.heldout(300)
    assert len({p.prompt for p in heldout}) == 300 and heldout == ProductsTask().heldout(300)
    train = task.train_batch(random.Random(1), 3000)
    assert not {p.prompt for p in heldout} & {p.prompt for p in train}
    shares = [ProductsTask.is_heldout(a, b) for a in range(100, 300) for b in range(100, 200)]
    assert 0.18 < sum(shares) / len(shares) < 0.22  # one fifth


def test_a_problem_is_a_3_digit_by_3_to_4_digit_product_with_its_answer():
    for p in ProductsTask().train_batch(random.Random(0), 200):
        a, b = map(int, p.prompt.removeprefix("Q: ").removesuffix("\nA:").split("*"))
        assert 100 <= a <= 999 and 100 <= b <= 9999 and p.answer == str(a * b)
