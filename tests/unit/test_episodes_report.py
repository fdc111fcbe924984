"""docs/results.md's episodes section is what bench/episodes.py --report makes of the committed data files, and
the verdict rule reads the paired effects (a negative control: swapped arms must fail)."""

import json
import shutil

from bench.episodes import BEGIN, DATA, END, RESULTS, report


def test_the_docs_section_is_rebuilt_from_the_data_files():
    committed = RESULTS.read_text().split(BEGIN, 1)[1].split(END, 1)[0]
    assert report(DATA) in committed


def test_negative_control_swapped_arms_fail_the_claim(tmp_path):
    data = tmp_path / "episodes"
    shutil.copytree(DATA, data)
    for path in data.glob("*-seed*.json"):  # episodes' results filed as single_turn's and the other way round
        record = json.loads(path.read_text())
        record["arm"] = "single_turn" if record["arm"] == "episodes" else "episodes"
        path.write_text(json.dumps(record))
    rows = [line for line in report(data).splitlines() if line.startswith("| episode accuracy |")]
    assert len(rows) == 1 and "**fails**" in rows[0], rows
