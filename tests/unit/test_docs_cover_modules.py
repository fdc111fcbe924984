"""Every module and package of rollout_farm/services/, rollout_farm/trainer/ and rollout_farm/integrations/ is named in
the docs.

docs/architecture.md promises that the file names are enough to find the owner of a behaviour; this keeps that true
when a module is added, moved or renamed.

The rule, simple and strict: a module `a/b/c.py` (every .py file but `__init__.py`) is covered when some doc contains
its path relative to the repository root, `a/b/c.py`, as written, not as the tail of a longer path (`x/a/b/c.py` does
not count) and not followed by more of a name (`c.pyi` does not count). A package (a folder with an `__init__.py`,
the three roots included) is covered when some doc contains its folder path with the trailing slash, `a/b/`, standing
on its own: followed by something that is not a name character, so that `rollout_farm/services/weights/push.py` names
the module but not the package `rollout_farm/services/weights/`. Bare file names (`push.py`) and dotted module names
(`rollout_farm.services.weights.push`) do not count: a table of bare names is fine for reading, but each module needs
its full path once, somewhere (docs/architecture.md lists every one). The docs are docs/*.md, README.md and
bench/README.md.

No module is imported: the check walks the folders and searches the text.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CODE = ("rollout_farm",)
NAME = r"[A-Za-z0-9_]"
PATH = r"[A-Za-z0-9_./-]"


def doc_texts(root: Path = ROOT) -> dict[str, str]:
    files = sorted((root / "docs").glob("*.md")) + [root / "README.md", root / "bench" / "README.md"]
    return {str(f.relative_to(root)): f.read_text(encoding="utf-8") for f in files}


def code_paths(root: Path = ROOT) -> list[str]:
    """Every module (`a/b/c.py`) and package (`a/b/`) under the code folders, relative to the root."""
    paths = []
    for top in CODE:
        for f in sorted((root / top).rglob("*.py")):
            rel = f.relative_to(root)
            if any(part.startswith(".") or part == "__pycache__" for part in rel.parts):
                continue
            if f.name == "__init__.py":
                paths.append(f"{rel.parent.as_posix()}/")
            else:
                paths.append(rel.as_posix())
    return paths


def named(path: str, text: str) -> bool:
    """Whether `text` names `path` under the rule of this module's docstring."""
    after = NAME if path.endswith("/") else f"{NAME}|\\.{NAME}"
    return re.search(f"(?<!{PATH}){re.escape(path)}(?!{after})", text) is not None


def missing(paths: list[str], texts: dict[str, str]) -> list[str]:
    return [p for p in paths if not any(named(p, t) for t in texts.values())]


def test_every_module_and_package_is_named_in_a_doc():
    paths = code_paths()
    assert (
        "rollout_farm/services/weights/push.py" in paths
        and "rollout_farm/services/rollout/" in paths
        and "rollout_farm/trainer/" in paths
    )
    absent = missing(paths, doc_texts())
    assert not absent, (
        "named in no doc (docs/*.md, README.md, bench/README.md) by its path from the repository root; "
        "add a line to docs/architecture.md: " + ", ".join(absent)
    )


def test_the_check_can_fail():
    """Negative controls: a made-up module, a bare file name, a longer path and a package named only through one of
    its modules are all reported missing."""
    texts = doc_texts()
    assert missing(["rollout_farm/services/rollout/not_a_module.py", "services/not_a_package/"], texts) == [
        "rollout_farm/services/rollout/not_a_module.py",
        "services/not_a_package/",
    ]
    assert missing(["rollout_farm/services/weights/push.py"], {"bare": "`push.py` in a table"}) == [
        "rollout_farm/services/weights/push.py"
    ]
    assert missing(["rollout_farm/services/weights/push.py"], {"longer": "tests/services/weights/push.py"}) == [
        "rollout_farm/services/weights/push.py"
    ]
    assert missing(["rollout_farm/services/weights/push.py"], {"stub": "rollout_farm/services/weights/push.pyi"}) == [
        "rollout_farm/services/weights/push.py"
    ]
    assert missing(["rollout_farm/services/weights/"], {"module": "`rollout_farm/services/weights/push.py`"}) == [
        "rollout_farm/services/weights/"
    ]
    assert missing(
        ["rollout_farm/services/weights/", "rollout_farm/services/weights/push.py"],
        {"ok": "`rollout_farm/services/weights/` (push.py)."},
    ) == ["rollout_farm/services/weights/push.py"]
    assert (
        missing(
            ["rollout_farm/services/weights/push.py"], {"ok": "see `rollout_farm/services/weights/push.py:WeightPush`"}
        )
        == []
    )
