"""The two images' Dockerfiles, without building them (CI has no Docker engine; bench/compose_smoke.sh builds the CPU
image by hand, docs/deploy.md "What was validated here"): hadolint, what they install from,
who they run as, their health check, the helper scripts they copy in, their layers, and that what they install
provides every import of the service and the trainer."""

import ast
import fnmatch
import re
import shutil
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import metadata
from pathlib import Path
from types import SimpleNamespace

import pytest
import tomllib
from packaging.requirements import Requirement

from deploy import constraints

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = [ROOT / "deploy/Dockerfile", ROOT / "deploy/Dockerfile.gpu"]
HADOLINT = shutil.which("hadolint", path=str(Path(sys.executable).parent))
PACKAGES = ("rollout_farm",)  # what pyproject.toml ships, all in both images
CODE = {"README.md", *PACKAGES}  # what the code layer copies; the dependency layer copies none of it
# modules that an image's extras need not provide: the GPU image gets SGLang from its base (SGLang's own image, the
# version asserted at build); the CPU image has no SGLang engine (imported lazily, so the rest imports without it).
# vLLM runs in an environment of its own (engine/vllm_side/'s modules run there, not in the images'): the images do
# not ship it (FARM_ENGINE=vllm needs FARM_VLLM_PYTHON)
NOT_FROM_EXTRAS = {"Dockerfile": {"sglang", "vllm"}, "Dockerfile.gpu": {"sglang", "vllm"}}


def lock_pin(name: str) -> str:
    return re.search(rf"^{name}==([^\s+]+)", (ROOT / "requirements.lock").read_text(), re.M).group(1)


def instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(KEYWORD, arguments) per instruction, continuation lines joined and comments dropped."""
    joined, out = "", []
    for line in dockerfile.read_text().splitlines():
        if line.lstrip().startswith("#") or not line.strip():
            continue
        joined += line.rstrip()[:-1] + " " if line.rstrip().endswith("\\") else line
        if not line.rstrip().endswith("\\"):
            keyword, _, args = joined.strip().partition(" ")
            out.append((keyword.upper(), args))
            joined = ""
    return out


def installed_extras(dockerfile: Path) -> set[str]:
    """The extras of the project that the Dockerfile's pip installs name (`".[a,b]"`)."""
    runs = " ".join(args for keyword, args in instructions(dockerfile) if keyword == "RUN")
    return {e for group in re.findall(r"\"\.\[([\w,-]+)\]\"", runs) for e in group.split(",")}


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_finds_nothing(dockerfile):
    done = subprocess.run([HADOLINT, "--no-color", str(dockerfile)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and not done.stdout.strip(), done.stdout + done.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_images_run_as_a_user_and_check_health_without_curl(dockerfile):
    text = dockerfile.read_text()
    assert re.findall(r"^USER (\S+)", text, re.M)[-1] == "1000:1000"
    (check,) = re.findall(r"^HEALTHCHECK .* CMD (.*)$", text, re.M)
    assert "deploy/healthcheck.py" in check and "curl" not in check and "wget" not in check
    assert "requirements.lock" in text


def test_the_cpu_image_installs_the_locked_torch_then_the_lock():
    text = DOCKERFILES[0].read_text()
    assert f"ARG TORCH_VERSION={lock_pin('torch')}" in text
    assert '-c requirements.lock ".[server,trainer]"' in text and "farm build-model" in text


def test_the_cpu_image_takes_its_base_and_torchs_index_as_build_arguments():
    """The base image and where torch's CPU wheel comes from are build arguments whose defaults are the public
    ones (python:3.11-slim-bookworm; PyTorch's CPU index), so the same file builds where neither is reachable:
    bench/compose_smoke.sh gives it a base made from Debian's packages and the wheel on loopback."""
    steps = instructions(DOCKERFILES[0])
    assert steps[:2] == [("ARG", "BASE_IMAGE=python:3.11-slim-bookworm"), ("FROM", "${BASE_IMAGE}")]
    assert ("ARG", "TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu") in steps and (
        "ARG",
        "TORCH_FIND_LINKS=",
    ) in steps
    (torch,) = [s for k, a in steps if k == "RUN" for s in a.split("&&") if '"torch==' in s]
    assert (
        '--index-url "${TORCH_INDEX_URL}"' in torch and '${TORCH_FIND_LINKS:+--find-links "$TORCH_FIND_LINKS"}' in torch
    )


@pytest.mark.parametrize("dockerfile", sorted((ROOT / "deploy/local").glob("*.Dockerfile")), ids=lambda p: p.name)
def test_the_local_redis_and_prometheus_images_lint_clean_and_run_as_their_user(dockerfile):
    """deploy/local/: Redis and Prometheus from Debian's packages, for a machine with no image registry (the
    compose smoke); hadolint finds nothing, and neither runs as root."""
    done = subprocess.run([HADOLINT, "--no-color", str(dockerfile)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and not done.stdout.strip(), done.stdout + done.stderr
    steps = instructions(dockerfile)
    assert steps[:2] == [("ARG", "BASE_IMAGE=debian:bookworm-slim"), ("FROM", "${BASE_IMAGE}")]
    assert [a for k, a in steps if k == "USER"][-1] in ("redis", "prometheus")


def canonical(name: str) -> str:
    return constraints.canonical(name)


def top_level_imports() -> dict[str, set[str]]:
    """Every module imported by absolute name anywhere in the shipped packages (function-level imports too), less
    the standard library and the packages themselves: module -> the files importing it."""
    found: dict[str, set[str]] = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                names = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                for name in names:
                    top = name.split(".")[0]
                    if top not in sys.stdlib_module_names and top not in PACKAGES and top != "__future__":
                        found.setdefault(top, set()).add(str(path.relative_to(ROOT)))
    return found


FREEZE_OMITS = {"pip", "setuptools", "wheel"}  # pip freeze (so the lock) leaves them out; every Python image has them


def own_extras(extras: set[str]) -> set[str]:
    """The project's extras that installing `extras` brings in, following self-references (trainer -> server)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    found, pending = set(), set(extras)
    while pending:
        extra = pending.pop()
        found.add(extra)
        for r in map(Requirement, project["optional-dependencies"][extra]):
            if canonical(r.name) == canonical(project["name"]):
                pending |= set(r.extras) - found
    return found


def locked_closure(extras: set[str]) -> dict[str, str]:
    """The distributions `pip install -c requirements.lock ".[extras]"` installs: the extras' requirements from
    pyproject.toml, then each requirement's own, transitively, from the metadata of the locked versions (the dev
    venv is the lock's `pip freeze`, which this checks for each one), markers evaluated for Linux on this Python.
    canonical name -> version."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    own = canonical(project["name"])
    pins = re.findall(r"^([^#=\s]+)==(\S+)", (ROOT / "requirements.lock").read_text(), re.M)
    lock = {canonical(n): v for n, v in pins}
    todo = [Requirement(r) for r in project["dependencies"]]
    for extra in own_extras(extras):
        todo += [r for r in map(Requirement, project["optional-dependencies"][extra]) if canonical(r.name) != own]
    closure: dict[str, str] = {}
    seen: set[tuple[str, frozenset]] = set()
    while todo:
        req = todo.pop()
        name = canonical(req.name)
        if (name, frozenset(req.extras)) in seen:
            continue
        seen.add((name, frozenset(req.extras)))
        try:
            version = metadata.version(name)
        except metadata.PackageNotFoundError:
            raise AssertionError(f"{name} ({req}) is not in the dev venv: reinstall it from requirements.lock")
        if name not in FREEZE_OMITS:
            assert name in lock, f"{name} ({req}) is not pinned in requirements.lock"
            assert version.split("+")[0] == lock[name].split("+")[0], f"{name}: venv {version}, lock {lock[name]}"
        closure[name] = version
        for line in metadata.requires(name) or []:
            sub = Requirement(line)
            if sub.marker is None or any(sub.marker.evaluate({"extra": e}) for e in req.extras or {""}):
                todo.append(sub)
    return closure


def unresolved_imports(extras: set[str], from_base: set[str]) -> dict[str, set[str]]:
    """Modules imported by the shipped code that no distribution installed for `extras` provides (nor the base)."""
    closure = locked_closure(extras)
    providers = metadata.packages_distributions()
    missing = {}
    for module, files in top_level_imports().items():
        if module in from_base:
            continue
        if not {canonical(d) for d in providers.get(module, [])} & set(closure):
            missing[module] = files
    return missing


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_each_image_installs_the_service_and_the_trainer_and_their_imports_resolve(dockerfile):
    """Both images hold `farm serve` and `farm train`: the chart runs a trainer on the CPU image (trainer.gpus=0) or
    the GPU one (trainer.gpus > 0). Every module that rollout_farm/services/, rollout_farm/trainer/ and
    rollout_farm/integrations/ import, at any depth, is provided by a distribution that the Dockerfile's extras bring in
    under requirements.lock (resolved from pyproject.toml and the locked packages' own metadata); SGLang alone comes
    from the GPU image's base, and is imported only inside functions, so the CPU image imports the same modules without
    it. Catches the old GPU image, which installed `.[server]`: verl and omegaconf, which rollout_farm/trainer/config.py
    and rollout_farm/integrations/verl import, were missing, so the trainer Job failed on every GPU install."""
    extras = installed_extras(dockerfile)
    missing = unresolved_imports(extras, NOT_FROM_EXTRAS[dockerfile.name])
    assert not missing, f"{dockerfile.name} installs .[{','.join(sorted(extras))}], which lacks {missing}"
    assert {"server", "trainer"} <= own_extras(extras)


def test_sglang_is_imported_only_where_its_engine_starts():
    for path in (p for package in PACKAGES for p in (ROOT / package).rglob("*.py")):
        for node in ast.parse(path.read_text()).body:  # module-level statements
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            assert not any(n.split(".")[0] == "sglang" for n in names), path


def test_the_import_check_can_fail():  # a negative control for the test above
    missing = unresolved_imports({"server"}, set())
    assert {"verl", "omegaconf", "sglang"} <= set(missing)
    assert "rollout_farm/trainer/config_sections.py" in missing["verl"]
    assert "cachetools" not in top_level_imports()  # verl's undeclared import: the extra lists it, no file here does


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_the_dependencies_are_a_layer_that_a_code_change_does_not_rebuild(dockerfile):
    """The RUN that installs the extras (torch and the lock's packages) follows COPYs of the project metadata only,
    and the code is copied after it and installed with --no-deps, so editing rollout_farm/services/ reuses the
    dependency layer. Catches the old Dockerfiles, which copied rollout_farm/services/, rollout_farm/trainer/ and
    rollout_farm/integrations/ before the one install."""
    steps = instructions(dockerfile)
    deps = next(i for i, (k, a) in enumerate(steps) if k == "RUN" and re.search(r"pip install .*\"\.\[", a))
    copied_before = {src for k, a in steps[:deps] if k == "COPY" for src in a.split()[:-1]}
    assert copied_before and not copied_before & CODE, copied_before
    assert {"pyproject.toml", "requirements.lock"} <= copied_before
    copied_after = {src for k, a in steps[deps:] if k == "COPY" for src in a.split()[:-1]}
    assert CODE <= copied_after
    later_installs = [a for k, a in steps[deps + 1 :] if k == "RUN" and "pip install" in a]
    assert later_installs and all("--no-deps" in a for a in later_installs), later_installs


def test_the_gpu_image_pins_its_bases_packages_and_checks_the_result():
    """The GPU image's install cannot move a package its base ships: the base's pip freeze (as name==version, from
    deploy/constraints.py --installed) is a constraint of the install, taken before it; `pip check` runs before and
    after, and the build fails on a requirement the install broke. Catches the old Dockerfile.gpu, which constrained
    only the lock's other packages and never ran pip check."""
    (deps,) = [a for k, a in instructions(DOCKERFILES[1]) if k == "RUN" and re.search(r"pip install .*\"\.\[", a)]
    steps = [s.strip() for s in deps.split("&&")]
    at = {
        name: next(i for i, s in enumerate(steps) if name in s)
        for name in (
            "pip freeze",
            "constraints.py --installed > /tmp/base-constraints.txt",
            "pip check > base-pip-check.txt",
            "pip install -c /tmp/base-constraints.txt -c /tmp/lock-constraints.txt",
            "constraints.py --check",
        )
    }
    install = at["pip install -c /tmp/base-constraints.txt -c /tmp/lock-constraints.txt"]
    assert at["pip freeze"] < install and at["constraints.py --installed > /tmp/base-constraints.txt"] < install
    assert at["pip check > base-pip-check.txt"] < install < at["constraints.py --check"]


def dist(name: str, version: str) -> SimpleNamespace:
    return SimpleNamespace(metadata={"Name": name}, version=version)


def test_base_pins_are_the_first_of_each_name_valid_and_less_what_is_released():
    dists = [
        dist("torch", "2.11.0+cu130"),
        dist("Torch", "2.0.0"),
        dist("sglang", "0.5.14"),
        dist("weird", "1.0-x y"),
        dist("packaging", "26.4"),
        dist("", "1"),
    ]
    pins, skipped = constraints.installed_pins(dists)
    assert pins == ["sglang==0.5.14", "torch==2.11.0+cu130"]  # sys.path's first torch; packaging is RELEASED
    assert skipped == ["weird 1.0-x y"]
    assert constraints.RELEASED and all(reason for reason in constraints.RELEASED.values())
    for name in constraints.RELEASED:  # the lock pins what the base's pin no longer does
        assert lock_pin(name)
        assert constraints.lock_without([f"{name}=={lock_pin(name)}"], {name}) == [f"{name}=={lock_pin(name)}"]


def test_pip_check_fails_only_on_what_the_install_broke(tmp_path):
    before = ["sglang 0.5.14 has requirement torch==2.11.0, but you have torch 2.11.1.\n"]
    assert constraints.new_problems(before, [before[0].strip()]) == []
    broke = "pyvers 0.1.0 has requirement packaging<26.0,>=25.0, but you have packaging 26.4."
    assert constraints.new_problems(before, [before[0], broke, "No broken requirements found."]) == [broke]
    (tmp_path / "before.txt").write_text("")  # this venv: pip check passes, so the check does
    check = [sys.executable, str(ROOT / "deploy/constraints.py"), "--check", str(tmp_path / "before.txt")]
    done = subprocess.run(check, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_gpu_image_leaves_no_build_cache_its_user_cannot_read():
    """Caches written as root while the image is built (the base's FlashInfer cubins and JIT kernels under
    /root/.cache, Triton's under /root/.triton, pip's) end up in uid 1000's HOME, owned by it, or are removed; the
    imports are then checked as uid 1000. Catches the old Dockerfile.gpu, which left them under /root (mode 700), so
    every Pod, running as uid 1000, rebuilt or fetched them again."""
    steps = instructions(DOCKERFILES[1])
    user = next(i for i, (k, a) in enumerate(steps) if k == "USER" and a == "1000:1000")
    last_root_run = max(i for i, (k, _) in enumerate(steps[:user]) if k == "RUN")
    relocate = steps[last_root_run][1]
    assert "rm -rf /root/.cache/pip" in relocate and "/root/.cache /root/.triton" in relocate
    assert "chown -R 1000:1000 /home/farm" in relocate
    assert ("ENV", "HOME=/home/farm") in steps[last_root_run:user]
    assert any(k == "RUN" and "import" in a and "trainer" in a and "sglang" in a for k, a in steps[user:])


def test_the_gpu_image_is_the_sglang_the_extra_pins():
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["sglang"]
    pinned = next(re.search(r"sglang\[srt\]==(\S+)", d).group(1) for d in extra if d.startswith("sglang"))
    steps = instructions(DOCKERFILES[1])
    assert ("ARG", f"SGLANG_VERSION={pinned}") in steps
    assert ("ARG", "BASE_IMAGE=lmsysorg/sglang:v${SGLANG_VERSION}-cu130") in steps, "the public default, unchanged"
    assert steps.index(("FROM", "${BASE_IMAGE}")) > steps.index(("ARG", f"SGLANG_VERSION={pinned}"))
    # whatever the base, the build stops unless it holds the pinned SGLang
    assert any(k == "RUN" and "assert sglang.__version__ == '${SGLANG_VERSION}'" in a for k, a in steps)


def test_gpu_constraints_keep_the_base_images_packages():
    lock = ["# pinned", "torch==2.13.0", "Transformers==4.57.0", "ruamel.yaml==0.19.1", "redis==8.1.0", ""]
    assert constraints.lock_without(lock, {"torch", "transformers", "ruamel-yaml"}) == ["redis==8.1.0"]
    assert constraints.lock_without(lock, set()) == lock[1:5]  # nothing installed: the whole lock


def test_the_build_context_keeps_what_the_dockerfiles_copy():
    ignored = [p.strip() for p in (ROOT / ".dockerignore").read_text().splitlines() if p.strip()]
    assert {".git", ".venv", "runs", ".env"} <= set(ignored)  # a small context, and no secrets in it
    for dockerfile in DOCKERFILES:
        for line in re.findall(r"^COPY (.+)$", dockerfile.read_text(), re.M):
            for source in line.split()[:-1]:
                assert (ROOT / source).exists(), source
                assert not any(fnmatch.fnmatch(source, p) or source.startswith(p + "/") for p in ignored), source


class Status(BaseHTTPRequestHandler):
    status = 200

    def do_GET(self):
        self.send_response(self.status)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("status, healthy", [(200, True), (503, False), (None, False)])
def test_the_health_check_passes_only_on_2xx(status, healthy):
    server = ThreadingHTTPServer(("127.0.0.1", 0), type("Handler", (Status,), {"status": status or 200}))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}/healthz"
    if status is None:  # nothing listening
        server.shutdown()
        server.server_close()
    env = {"PATH": "/usr/bin:/bin", "HEALTHCHECK_URL": url, "HEALTHCHECK_TIMEOUT_S": "5"}
    check = [sys.executable, str(ROOT / "deploy/healthcheck.py")]
    done = subprocess.run(check, env=env, capture_output=True, text=True, timeout=30)
    assert (done.returncode == 0) == healthy, done.stderr
    if not healthy:
        assert url in done.stderr
    if status is not None:
        server.shutdown()


def test_hadolint_rejects_what_it_should(tmp_path):  # the lint above can fail
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python\nRUN apt-get update && apt-get install curl\n")
    done = subprocess.run([HADOLINT, "--no-color", str(bad)], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "DL3006" in done.stdout and "DL3008" in done.stdout
