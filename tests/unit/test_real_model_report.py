"""bench/real_model.py's report on synthetic per-seed files: McNemar counts, the verdict across seeds with negative
controls (no gain, and gains of mixed sign, must not read as "holds"), a part per arm in the order they were run, and
a byte-identical rebuild. No service."""

import json
from pathlib import Path

import pytest

from bench import real_model
from bench.common import write_record
from bench.real_model_probe import grades as probe_grades
from bench.real_model_probe import report as probe_table

N = 200
NO_PROBE = Path("/nonexistent/probe.json")


def grades(right: set[int]) -> str:
    return "".join("1" if i in right else "0" for i in range(N))


def write_seeds(folder, gains: list[int], lost: int = 2, lr: str = "1e-05", date: str = "2026-12-03") -> None:
    """Seed k: 40 problems right before; after, `lost` of them wrong (more for a negative gain) and enough others
    right for a net gain of `gains[k]` problems."""
    folder.mkdir(parents=True, exist_ok=True)
    for seed, gain in enumerate(gains):
        before = set(range(40))
        wrong = lost + max(0, -gain)
        after = (before - set(range(wrong))) | set(range(100, 100 + wrong + gain))
        record = {
            "seed": seed,
            "overrides": ["trainer.task=addition", f"actor_rollout_ref.actor.optim.lr={lr}"],
            "wall_s": 1500.0,
            "commit": "0123456789abcdef",
            "date": f"{date}T10:00:{seed:02d}",
            "machine": {"cpus": 2, "torch": "2.13.0"},
            "before": grades(before),
            "after": grades(after),
            "steps": [{"step": 9, "val_accuracy": 0.3}, {"step": 18, "val_accuracy": 0.4}],
        }
        write_record(folder / f"seed{seed}.json", record)


def test_mcnemar_counts_the_discordant_problems():
    gained, lost, p = real_model.mcnemar("0011", "0110")
    assert (gained, lost) == (1, 1) and p == pytest.approx(1.0)
    gained, lost, p = real_model.mcnemar("0" * 20, "1" * 12 + "0" * 8)
    assert (gained, lost) == (12, 0) and p == pytest.approx(2 * 0.5**12)


def test_a_consistent_gain_holds(tmp_path):
    write_seeds(tmp_path, [30, 34, 32])
    text = real_model.report([tmp_path], NO_PROBE)
    assert "**Verdict: holds**" in text and "paired t-test p = " in text
    assert "| 0 | 0.200 | 0.350 | +0.150 | 32 | 2 |" in text  # 40 -> 70 right of 200
    assert "9: 0.300, 18: 0.400" in text


@pytest.mark.parametrize(
    "gains,verdict",
    [
        ([0, 0, 0], "inconclusive"),  # negative control: nothing learnt (equal gains and losses)
        ([30, -30, 2], "inconclusive"),  # negative control: seeds that disagree
        ([-30, -34, -32], "fails"),  # negative control: it unlearns
        ([30, 34], "inconclusive"),  # two seeds: no test, no verdict
    ],
)
def test_noise_does_not_hold(tmp_path, gains, verdict):
    write_seeds(tmp_path, gains)
    assert f"**Verdict: {verdict}**" in real_model.report([tmp_path], NO_PROBE)


def test_identical_gains_name_the_sign_test_and_give_no_interval(tmp_path):
    write_seeds(tmp_path, [30, 30, 30])
    text = real_model.report([tmp_path], NO_PROBE)
    assert "none (fewer than 3 seeds, or no spread), exact sign test (the gains do not vary) p = 0.25" in text
    assert "**Verdict: inconclusive**" in text  # three seeds of one sign: p = 0.25, no verdict


def test_each_arm_has_its_part_in_the_order_it_was_run(tmp_path):
    write_seeds(tmp_path / "lr3e-05", [-4, 44, -8], lr="3e-05", date="2026-12-01")
    write_seeds(tmp_path / "lr1e-05", [74, 88, 60], lr="1e-05", date="2026-12-02")
    text = real_model.report(sorted(tmp_path.glob("lr*")), NO_PROBE)  # sorted by name, lr1e-05 would come first
    first, second = text.index("### lr 3e-05: 3 seeds"), text.index("### lr 1e-05: 3 seeds")
    assert first < second
    assert text[first:second].count("**Verdict: inconclusive**") == 1
    assert text[second:].count("**Verdict: holds**") == 1
    assert f"Data: `{(tmp_path / 'lr3e-05').resolve()}/`" in text[first:second]
    assert f"Data: `{(tmp_path / 'lr1e-05').resolve()}/`" in text[second:]


def test_the_section_rebuilds_byte_for_byte(tmp_path, monkeypatch):
    write_seeds(tmp_path, [30, 34, 32])
    md = tmp_path / "results.md"
    md.write_text(f"# Results\n\n{real_model.BEGIN}\nSTALE TEXT\n{real_model.END}\n\nafter\n")
    monkeypatch.setattr(real_model, "RESULTS_MD", md)
    real_model.replace_section(real_model.report([tmp_path], NO_PROBE))
    first = md.read_text()
    real_model.replace_section(real_model.report([tmp_path], NO_PROBE))
    assert md.read_text() == first and "STALE TEXT" not in first and first.endswith("\n\nafter\n")
    assert json.loads((tmp_path / "seed0.json").read_text())["steps"][1]["step"] == 18


def test_the_probe_grades_tell_a_stated_sum_from_a_last_number():
    assert probe_grades("54 + 65 = 119", "119") == {"last": True, "anywhere": True, "alone": False}
    assert probe_grades("The answer is 119. Then 12 more.", "119") == {"last": False, "anywhere": True, "alone": False}
    assert probe_grades(" 119.", "119") == {"last": True, "anywhere": True, "alone": True}
    assert probe_grades("1190 or 11 9", "119") == {
        "last": False,
        "anywhere": False,
        "alone": False,
    }  # whole numbers only


def test_the_probe_table_joins_the_section(tmp_path, monkeypatch):
    monkeypatch.setattr(real_model, "DATA", tmp_path)
    write_seeds(tmp_path / "lr1e-05", [74, 88, 60])
    texts = {"base": ["The sum is 85, or 86", "12"], "seed 0": ["85", "1 + 2 = 13"]}
    answers = {k: [{"text": t, **probe_grades(t, a)} for t, a in zip(v, ["85", "13"])] for k, v in texts.items()}
    probe = tmp_path / "probe.json"
    probe.write_text(json.dumps({"problems": ["p", "q"], "lr": [1e-5], "commit": "abcdef0123", "answers": answers}))
    text = real_model.report([tmp_path / "lr1e-05"], probe)
    assert "### Skill or format: the same answers graded three ways (lr 1e-05)" in text
    assert "| base | 0.000 | 0.500 | 0.000 | 1.5 |" in text  # the sum stated, then another number: not last
    assert "| seed 0 | 1.000 | 1.000 | 0.500 | 2.0 |" in text
    assert "| seed 0 | 1.000 | 1.000 | 0.500 | 2.0 | no run file |" in text  # its run graded 200 problems, not 2


def test_the_probe_sets_its_grades_beside_the_runs():
    answers = [{"text": t, **probe_grades(t, "7")} for t in ("7", "8", "3 + 4 = 7")]
    table = probe_table({"answers": {"seed 0": answers}}, {"seed 0": "100"})
    assert "| seed 0 | 0.667 | 0.667 | 0.333 | 1.7 | 2/3 |" in table  # the run said the third was wrong
