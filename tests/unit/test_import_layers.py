"""The folders are the architecture: every module imports, and no two parts of `rollout_farm/services/` import each
other.

A part is a sub-package (`rollout_farm/services/weights/`, `rollout_farm/services/replica/`, ...) or a top-level module
(`rollout_farm/services/errors.py`). Every import counts, also one inside a function or under `if TYPE_CHECKING:`: a
reader follows those arrows too. An import from a part into itself is no arrow. The parts' graph must have no circle,
and neither may the modules'.
"""

import ast
import importlib
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = ("services", "trainer", "integrations")
BUILDS_AT_IMPORT = {
    "rollout_farm.services.serve_entry"
}  # `serve run`'s entry: importing it builds the app from FARM_* settings


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(package: str) -> dict[str, pathlib.Path]:
    return {module_name(p): p for p in sorted((ROOT / "rollout_farm" / package).rglob("*.py"))}


def imported(path: pathlib.Path, name: str, known: set[str]) -> set[str]:
    """The modules of `known` that the file imports (`from a.b import c` counts as a.b.c when that is a module)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t:
                out.add(t)
    return out - {name}


def part(module: str) -> str:
    """rollout_farm.services.weights.push -> rollout_farm.services.weights; rollout_farm.services.errors ->
    rollout_farm.services.errors."""
    return ".".join(module.split(".")[:3])


def circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of the graph as a path [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        path.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return path[path.index(m) :] + [m]
            if m not in state and (found := visit(m)):
                return found
        path.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (found := visit(n)):
            return found
    return None


def services_graphs() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(module graph, part graph) of services/."""
    mods = modules("services")
    known = set(mods)
    by_module = {m: imported(p, m, known) for m, p in mods.items()}
    by_part: dict[str, set[str]] = {}
    for m, targets in by_module.items():
        by_part.setdefault(part(m), set()).update(part(t) for t in targets if part(t) != part(m))
    return by_module, by_part


@pytest.mark.parametrize("package", PACKAGES)
def test_every_module_imports(package):
    for name in sorted(set(modules(package)) - BUILDS_AT_IMPORT):
        importlib.import_module(name)


def test_no_circle_between_the_parts_of_services():
    _, by_part = services_graphs()
    assert {
        "rollout_farm.services.rollout",
        "rollout_farm.services.weights",
        "rollout_farm.services.replica",
        "rollout_farm.services.engine",
    } <= set(by_part)
    assert circle(by_part) is None, f"parts of rollout_farm/services/ import each other: {' -> '.join(circle(by_part))}"


def test_no_circle_between_modules():
    by_module, _ = services_graphs()
    assert circle(by_module) is None, f"modules import each other: {' -> '.join(circle(by_module))}"


def test_weights_take_the_replicas_handle_and_do_not_import_it():
    _, by_part = services_graphs()
    assert "rollout_farm.services.replica" not in by_part["rollout_farm.services.weights"]
    # the replicas stage weights (rollout_farm/services/weights/stage.py)
    assert "rollout_farm.services.weights" in by_part["rollout_farm.services.replica"]


def test_the_check_finds_a_circle_and_reads_every_kind_of_import(tmp_path):
    """Negative controls: a circle two parts deep is found, and a lazy or TYPE_CHECKING import is an arrow."""
    assert circle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert circle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None
    src = tmp_path / "x.py"
    src.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
        "    from rollout_farm.services.replica.handle import Replicas\n"
        "def f():\n    from rollout_farm.services.weights import push\n"
    )
    known = {
        "rollout_farm.services.replica.handle",
        "rollout_farm.services.weights",
        "rollout_farm.services.weights.push",
    }
    assert imported(src, "rollout_farm.services.x", known) == {
        "rollout_farm.services.replica.handle",
        "rollout_farm.services.weights",
        "rollout_farm.services.weights.push",
    }
