"""bench/README.md's engines table is what bench/engines.py --report makes of the committed docs/data/engines.json,
and its verdicts read the paired ratios (negative controls: the farm on vLLM at half of vLLM alone's speed must fail
the 0.9 goal; the two farm engines' figures swapped must swap which one is faster)."""

import copy
import json

from bench.engines import BEGIN, END, JSON, README, render


def committed() -> dict:
    return json.loads(JSON.read_text())


def verdicts(data: dict) -> list[tuple[str, str]]:
    """(verdict on the 0.9 goal, the faster engine) per row of the table."""
    rows = render(data).split("\n\n", 1)[0].splitlines()[2:]  # past the header and its rule
    return [tuple(cell.rsplit(": ", 1)[1] for cell in row.strip("| ").split(" | ")[-2:]) for row in rows]


def test_the_readme_table_is_rebuilt_from_the_data():
    table = README.read_text().split(BEGIN + "\n", 1)[1].split(END, 1)[0]
    assert table == render(committed())


def test_negative_control_a_farm_at_half_speed_fails_the_goal():
    data = committed()
    for case in data["cases"].values():
        alone = case["tokens_s"]["vllm_alone"]
        case["tokens_s"]["farm_vllm"] = [a * (0.5 + 0.01 * i) for i, a in enumerate(alone)]
    said = verdicts(data)
    assert len(said) == len(data["cases"]) and all(goal == "fails" for goal, _ in said), said


def test_negative_control_swapped_engines_swap_the_faster_one():
    data, swapped = committed(), copy.deepcopy(committed())
    for case in swapped["cases"].values():
        t = case["tokens_s"]
        t["farm_vllm"], t["farm_torch"] = t["farm_torch"], t["farm_vllm"]
    flip = {"vLLM": "torch", "torch": "vLLM", "inconclusive": "inconclusive"}
    assert [flip[f] for _, f in verdicts(data)] == [f for _, f in verdicts(swapped)]
