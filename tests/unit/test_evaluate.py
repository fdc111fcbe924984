"""Held-out accuracy: Wilson intervals and the paired gain."""

import pytest

from rollout_farm.trainer.evaluate import Accuracy, paired_gain


def test_wilson_interval_known_values():
    lo, hi = Accuracy([True] * 50 + [False] * 50).wilson()
    assert (lo, hi) == (pytest.approx(0.4038, abs=1e-3), pytest.approx(0.5962, abs=1e-3))
    lo, hi = Accuracy([False] * 416).wilson()
    assert lo == 0.0 and hi == pytest.approx(0.0091, abs=5e-4)


def test_paired_gain_matches_hand_computation():
    before = [False, False, True, True, False, True, False, False]
    after = [True, False, True, False, True, True, True, False]
    gain, half = paired_gain(before, after)
    d = [1, 0, 0, -1, 1, 0, 1, 0]
    mean = sum(d) / 8
    sd = (sum((x - mean) ** 2 for x in d) / 7) ** 0.5
    assert gain == pytest.approx(mean) and half == pytest.approx(1.959964 * sd / 8**0.5)
    assert paired_gain([True] * 5, [True] * 5) == (0.0, 0.0)
