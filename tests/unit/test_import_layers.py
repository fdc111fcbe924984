"""The folders are the architecture: every module imports, and no two parts of `rollout_farm/services/` import each
other.

A part is a sub-package (`rollout_farm/services/weights/`, `rollout_farm/services/replica/`, ...) or a top-level module
(`rollout_farm/services/errors.py`). Every import counts, also one inside a function or under `if TYPE_CHECKING:`: a
reader follows those arrows too. An import from a part into itself is no arrow. The parts' graph must have no circle,
and neither may the modules'.

The trainer and the integrations sit beside the service, not on it: they import only its base modules (SERVICE_BASE),
never the ingress's domain packages, and rollout_farm/trainer/cli.py also the server and its settings for `farm serve`.
"""

import ast
import importlib
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = ("services", "trainer", "integrations")
BUILDS_AT_IMPORT = {
    "rollout_farm.services.serving.serve_entry"
}  # `serve run`'s entry: importing it builds the app from FARM_* settings
# What rollout_farm/trainer/ and rollout_farm/integrations/ may import of rollout_farm/services/ (docs/architecture.md,
# the layers): the base modules, every module of protocol/ and the packages themselves (docstrings). rewards.py is
# one (rollout_farm/trainer/evaluate.py grades the last number with it). samplers.py is one: the sampler plug-in API,
# which imports only protocol/ and registry.py; rollout_farm/trainer/algorithms/stale_samples.py asks the configured
# sampler (a plug-in too) for its effective params at config load, before any service is up.
SERVICE_BASE = {
    "rollout_farm.services",
    "rollout_farm.services.client",  # its public names (FarmClient, AsyncFarmClient, FarmError)
    "rollout_farm.services.client.farm_client",
    "rollout_farm.services.client.calls",  # the client's calls on the wire (FarmError)
    "rollout_farm.services.protocol",
    "rollout_farm.services.models",
    "rollout_farm.services.extensions",
    "rollout_farm.services.extensions.tasks",
    "rollout_farm.services.extensions.registry",
    "rollout_farm.services.extensions.rewards",
    "rollout_farm.services.extensions.samplers",
    "rollout_farm.services.observability",
    "rollout_farm.services.observability.logs",
    "rollout_farm.services.net",
    "rollout_farm.services.weights.pusher",
    "rollout_farm.services.weights.path_pusher",  # the client's push by path (a safetensors file, then a call)
    "rollout_farm.services.weights.state_dict",
    "rollout_farm.services.client.peft_files",  # a peft folder's files (stdlib only)
    "rollout_farm.services.adapters.digest",  # the policy digest a trainer checks its samples against
    "rollout_farm.services.adapters.peft_format",  # peft's adapter config, read as the farm reads it
}
CLI = "rollout_farm.trainer.cli"
CLI_ALSO = {"rollout_farm.services.serving.server", "rollout_farm.services.config.settings"}  # `farm serve`


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


def may_import(importer: str, target: str) -> bool:
    """Whether a module of the trainer or the integrations may import `target`."""
    if target != "rollout_farm.services" and not target.startswith("rollout_farm.services."):
        return True
    if target in SERVICE_BASE or target.startswith("rollout_farm.services.protocol."):
        return True
    return importer == CLI and target in CLI_ALSO


def forbidden(mods: dict[str, pathlib.Path], known: set[str]) -> list[str]:
    """'importer -> target' for each import of rollout_farm/services/ that the modules `mods` may not make."""
    return sorted(f"{m} -> {t}" for m, p in mods.items() for t in imported(p, m, known) if not may_import(m, t))


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


def test_the_trainer_and_the_integrations_import_only_the_services_base_modules():
    mods = modules("trainer") | modules("integrations")
    known = set(modules("services")) | set(mods)
    assert {CLI, "rollout_farm.trainer.sync.rollouts", "rollout_farm.integrations.verl.server"} <= set(mods)
    bad = forbidden(mods, known)
    assert not bad, (
        "the trainer and the integrations import only the service's base modules (docs/architecture.md, the layers); "
        "move what they need down to one (a pure function on the wire models goes to rollout_farm/services/protocol/): "
        + ", ".join(bad)
    )


def test_the_trainer_rule_reports_a_forbidden_import(tmp_path):
    """Negative control: a domain package imported lazily is reported, so is the server outside cli.py, and the base
    modules (protocol/'s modules, weights/pusher.py) are not."""
    src = tmp_path / "x.py"
    src.write_text(
        "from rollout_farm.services.protocol.episode_groups import as_group\n"
        "from rollout_farm.services.weights.pusher import WeightPusher\n"
        "def f():\n    from rollout_farm.services.episodes.episodes import Episodes\n"
        "    from rollout_farm.services.serving.server import run_forever\n"
    )
    known = set(modules("services"))
    assert forbidden({"rollout_farm.trainer.x": src}, known) == [
        "rollout_farm.trainer.x -> rollout_farm.services.episodes.episodes",
        "rollout_farm.trainer.x -> rollout_farm.services.serving.server",
    ]
    assert forbidden({CLI: src}, known) == [f"{CLI} -> rollout_farm.services.episodes.episodes"]


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
