"""bench/real_model.py's report on synthetic per-seed files: McNemar counts, the verdict across seeds with negative
controls (no gain, and gains of mixed sign, must not read as "holds"), and a byte-identical rebuild. No service."""

import json

import pytest

from bench import real_model

N = 200


def grades(right: set[int]) -> str:
    return "".join("1" if i in right else "0" for i in range(N))


def write_seeds(folder, gains: list[int], lost: int = 2) -> None:
    """Seed k: 40 problems right before; after, `lost` of them wrong (more for a negative gain) and enough others
    right for a net gain of `gains[k]` problems."""
    for seed, gain in enumerate(gains):
        before = set(range(40))
        wrong = lost + max(0, -gain)
        after = (before - set(range(wrong))) | set(range(100, 100 + wrong + gain))
        record = {
            "seed": seed,
            "overrides": ["trainer.task=addition"],
            "wall_s": 1500.0,
            "commit": "0123456789abcdef",
            "date": "2026-12-03T10:00:00",
            "machine": {"cpus": 2, "torch": "2.13.0"},
            "before": grades(before),
            "after": grades(after),
            "steps": [{"step": 9, "val_accuracy": 0.3}, {"step": 18, "val_accuracy": 0.4}],
        }
        real_model.write(folder / f"seed{seed}.json", record)


def test_mcnemar_counts_the_discordant_problems():
    gained, lost, p = real_model.mcnemar("0011", "0110")
    assert (gained, lost) == (1, 1) and p == pytest.approx(1.0)
    gained, lost, p = real_model.mcnemar("0" * 20, "1" * 12 + "0" * 8)
    assert (gained, lost) == (12, 0) and p == pytest.approx(2 * 0.5**12)


def test_a_consistent_gain_holds(tmp_path):
    write_seeds(tmp_path, [30, 34, 32])
    text = real_model.report(tmp_path)
    assert "**Verdict: holds**" in text
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
    assert f"**Verdict: {verdict}**" in real_model.report(tmp_path)


def test_the_section_rebuilds_byte_for_byte(tmp_path, monkeypatch):
    write_seeds(tmp_path, [30, 34, 32])
    md = tmp_path / "results.md"
    md.write_text(f"# Results\n\n{real_model.BEGIN}\nSTALE TEXT\n{real_model.END}\n\nafter\n")
    monkeypatch.setattr(real_model, "RESULTS_MD", md)
    real_model.replace_section(real_model.report(tmp_path))
    first = md.read_text()
    real_model.replace_section(real_model.report(tmp_path))
    assert md.read_text() == first and "STALE TEXT" not in first and first.endswith("\n\nafter\n")
    assert json.loads((tmp_path / "seed0.json").read_text())["steps"][1]["step"] == 18
