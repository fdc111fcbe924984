"""Each package's `__init__` docstring is the one table of its modules, and it cannot drift from the folder.

A newcomer finds the owner of a behaviour by opening a folder's `__init__.py`: its docstring holds a table whose
header is `| module | owns |` and whose first column names, in backticks, every module (`x.py`, `__init__.py` aside)
and every sub-package (`x/`) of the folder, and nothing that is not there (a data folder such as `presets/` may be
listed too). docs/architecture.md keeps the layers and the walk-throughs and links to every package, so the tables
are written once. No module is imported: the check reads the files.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CODE = ROOT / "rollout_farm"
HEADER = re.compile(r"^\|\s*module\s*\|\s*owns\s*\|\s*$", re.M)
ROW = re.compile(r"^\|\s*`([^`]+)`\s*\|(.*)\|\s*$")

# The review's questions, each answered by one row of one package's table: (question, module, words in its row).
OWNERS = [
    ("where a session's KV cache is evicted", "rollout_farm/services/engine/torch/session_cache.py", r"evict"),
    ("where a push is checked for NaN", "rollout_farm/services/weights/checks.py", r"NaN"),
    ("where a retry finds its running job", "rollout_farm/services/rollout/jobs.py", r"retry"),
    (
        "where the GRPO advantage is computed for episodes",
        "rollout_farm/trainer/algorithms/estimators.py",
        r"GRPO|grpo",
    ),
    ("where the chat template is rendered", "rollout_farm/services/chat/template.py", r"chat template"),
    ("where a tool call is parsed", "rollout_farm/services/chat/tool_formats/base.py", r"tool call"),
]


def packages(root: Path = CODE) -> list[Path]:
    return sorted(p.parent for p in root.rglob("__init__.py") if "__pycache__" not in p.parts)


def listing(package: Path) -> set[str]:
    """What the folder holds: its modules (`x.py`) and sub-packages (`x/`)."""
    modules = {p.name for p in package.glob("*.py") if p.name != "__init__.py"}
    subs = {f"{p.name}/" for p in package.iterdir() if (p / "__init__.py").is_file()}
    return modules | subs


def table(docstring: str) -> dict[str, str]:
    """The rows of the docstring's `| module | owns |` table: name -> what it owns; {} without one."""
    match = HEADER.search(docstring or "")
    if not match:
        return {}
    rows = {}
    for line in docstring[match.end() :].strip("\n").splitlines()[1:]:  # past the |---| line
        row = ROW.match(line.strip())
        if not row:
            break
        rows[row.group(1)] = row.group(2).strip()
    return rows


def docstring(package: Path) -> str:
    return ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""


def drift(package: Path, rows: dict[str, str]) -> tuple[set[str], set[str]]:
    """(in the folder but not the table, in the table but not the folder)."""
    present = listing(package)
    extra = {name for name in rows if name not in present and not (package / name.rstrip("/")).exists()}
    return present - set(rows), extra


@pytest.mark.parametrize("package", packages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_the_package_docstring_is_the_table_of_its_folder(package):
    rows = table(docstring(package))
    assert rows, f"{package.relative_to(ROOT)}/__init__.py has no `| module | owns |` table in its docstring"
    missing, stale = drift(package, rows)
    assert not missing, f"{package.relative_to(ROOT)}: add a row for {sorted(missing)}"
    assert not stale, f"{package.relative_to(ROOT)}: the table names {sorted(stale)}, which the folder lacks"
    assert all(rows.values()), f"{package.relative_to(ROOT)}: a row says nothing"


def test_architecture_links_every_package():
    text = (ROOT / "docs" / "architecture.md").read_text()
    for package in packages():
        target = (package / "__init__.py").relative_to(ROOT).as_posix()
        assert f"(../{target})" in text, f"docs/architecture.md does not link {target}"


@pytest.mark.parametrize("question,module,words", OWNERS, ids=[q for q, _, _ in OWNERS])
def test_the_owner_is_in_the_first_file_a_newcomer_opens(question, module, words):
    path = ROOT / module
    rows = table(docstring(path.parent))
    assert path.is_file(), f"{module} does not exist"
    assert re.search(words, rows.get(path.name, "")), f"{question}: the row of {path.name} does not say /{words}/"


def test_the_check_can_fail(tmp_path):
    """Negative controls: a module missing from the table, a row for a module that is gone, and no table at all."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("")
    (pkg / "b.py").write_text("")
    rows = "| module | owns |\n| --- | --- |\n| `a.py` | A |\n| `gone.py` | G |\n"
    (pkg / "__init__.py").write_text(f'"""Pkg.\n\n{rows}"""')
    rows = table(docstring(pkg))
    assert rows == {"a.py": "A", "gone.py": "G"}
    assert drift(pkg, rows) == ({"b.py", "sub/"}, {"gone.py"})
    assert table("no table here") == {}
