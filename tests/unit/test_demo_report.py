"""The demo's report: both accuracies, and an honest verdict on the any-format one (it must be able to say "falls")."""

from rollout_farm.trainer.demo import report
from rollout_farm.trainer.evaluate import Accuracy


def summary(before_numbers: list[bool], after_numbers: list[bool]) -> dict:
    n = len(before_numbers)
    return {
        "before": Accuracy([False] * n, before_numbers).as_dict(),
        "after": Accuracy(after_numbers, after_numbers).as_dict(),
        "final_weight_version": 80,
    }


def test_report_prints_both_accuracies_and_says_holds_within_noise(capsys):
    before = [True] * 220 + [False] * 196
    after = [True] * 215 + [False] * 5 + [True] * 3 + [False] * 193  # 218/416: two fewer, paired
    report(summary(before, after), wall_s=300)
    out = capsys.readouterr().out
    assert "after RL  : 0.524" in out
    assert "before  : 0.529" in out and "after   : 0.524" in out
    assert "-> holds (within noise)" in out


def test_report_says_falls_when_the_skill_is_lost(capsys):
    before = [True] * 220 + [False] * 196
    after = [True] * 150 + [False] * 266  # 70 sums lost
    report(summary(before, after), wall_s=300)
    assert "-> falls" in capsys.readouterr().out


def test_report_says_rises_when_the_skill_improves(capsys):
    before = [True] * 200 + [False] * 216
    after = [True] * 260 + [False] * 156
    report(summary(before, after), wall_s=300)
    assert "-> rises" in capsys.readouterr().out
