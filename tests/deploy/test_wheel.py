"""The wheel installs one top-level name, `rollout_farm`, so the project never collides with a user's own
`services/` or `trainer/` package, and every internal path stays behind the small public surface.

The wheel is built from a copy of the sources (setuptools writes build/ and *.egg-info next to what it builds) with
the venv's setuptools and no network (`--no-build-isolation`), and its file list is read from the zip."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def top_level_names(wheel: Path) -> set[str]:
    """The first path component of every file in the wheel, less its own metadata folder."""
    with zipfile.ZipFile(wheel) as z:
        names = {n.split("/")[0] for n in z.namelist()}
    return {n for n in names if not n.endswith(".dist-info")}


def test_the_wheel_installs_only_rollout_farm(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src)
    for entry in ROOT.iterdir():  # every package at the root, so a stray one would be found by pyproject's `find`
        if (entry / "__init__.py").is_file():
            shutil.copytree(entry, src / entry.name, ignore=shutil.ignore_patterns("__pycache__"))
    build = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", tmp_path / "out"]
    done = subprocess.run([*map(str, build), str(src)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    (wheel,) = (tmp_path / "out").glob("rollout_farm-*.whl")

    assert top_level_names(wheel) == {"rollout_farm"}
    with zipfile.ZipFile(wheel) as z:  # the data the packages read at run time travels with them
        files = set(z.namelist())
    assert "rollout_farm/trainer/presets/design.yaml" in files
    assert "rollout_farm/services/data/gsm8k/test.jsonl" in files


def test_the_check_can_fail(tmp_path):
    """Negative control: a wheel that also ships `services/` is reported."""
    wheel = tmp_path / "x-0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("rollout_farm/__init__.py", "")
        z.writestr("services/__init__.py", "")
        z.writestr("x-0.dist-info/METADATA", "")
    assert top_level_names(wheel) == {"rollout_farm", "services"}


def test_the_public_surface_imports_without_the_server():
    """`from rollout_farm import FarmClient` and the wire models import nothing of the service or trainer."""
    script = (
        "import sys, json\n"
        "from rollout_farm import AsyncFarmClient, FarmClient\n"
        "from rollout_farm.protocol import RolloutRequest, SamplingParams, sessions, episodes\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('torch', 'ray', 'fastapi', 'transformers', 'verl') or m.startswith('rollout_farm.trainer'))))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.strip() == "[]"
