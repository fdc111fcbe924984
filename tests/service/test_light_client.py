"""The client installs light: a fresh venv with the project's default install only runs a rollout against the
session's service, and torch, Ray, verl, transformers and FastAPI are neither installed there nor imported.

The venv installs the project with its declared dependencies, pinned by requirements.lock, so this checks
pyproject.toml's default install itself, not a list of packages kept here. pip builds a local folder in place
(leaving a build/ folder), so it builds a copy of the sources."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

from rollout_farm.services import protocol as P
from tests.conftest import TOKEN

ROOT = Path(__file__).resolve().parents[2]
SERVER_ONLY = ("torch", "ray", "verl", "transformers", "fastapi", "uvicorn", "pydantic_settings")
# Run by the light venv's python: one rollout, then what it could import and what it did import.
SCRIPT = """
import importlib.util, json, sys
import rollout_farm
from rollout_farm import FarmClient
from rollout_farm.protocol import RolloutRequest

url, token, request, heavy = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4].split(",")
with FarmClient(url, token) as c:
    response = c.rollouts(RolloutRequest.model_validate_json(request))
print(json.dumps({
    "response": response.model_dump(mode="json"),
    "client": rollout_farm.__file__,
    "installed": [m for m in heavy if importlib.util.find_spec(m)],
    "imported": sorted(m for m in sys.modules if m.split(".")[0] in heavy),
    "ours": sorted(m for m in sys.modules if m.split(".")[0] == "rollout_farm"),
}))
"""


def run(cmd: list, timeout: float, **kw) -> str:
    """The command's stdout; its stderr in the failure."""
    done = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, **kw)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


def tokens(response: P.RolloutResponse) -> list[list[list[int]]]:
    return [[s.token_ids for s in g.samples] for g in response.groups]


def light_venv(root: Path) -> Path:
    """A venv holding `pip install -c requirements.lock <the project>` and nothing else (not even pip); returns its
    python."""
    src = root / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src)
    for package in (d for d in ROOT.iterdir() if (d / "__init__.py").is_file()):  # pyproject.toml picks among them
        shutil.copytree(package, src / package.name, ignore=shutil.ignore_patterns("__pycache__"))
    run([sys.executable, "-m", "venv", "--without-pip", root / "venv"], timeout=60)  # this pip installs into it
    python = root / "venv" / "bin" / "python"
    pip = [sys.executable, "-m", "pip", "--python", python, "install", "-q", "--disable-pip-version-check"]
    run([*pip, "-c", ROOT / "requirements.lock", src], timeout=300)
    return python


def test_the_client_alone_installs_light_and_runs_a_rollout(service, client, tmp_path):
    python = light_venv(tmp_path)
    req = P.RolloutRequest(
        prompts=[P.Prompt(text="Q: 3+4\nA:", ground_truth="7"), P.Prompt(text="Q: 5+6\nA:", ground_truth="11")],
        n=2,
        sampling_params=P.SamplingParams(temperature=0.0, max_new_tokens=6),
        reward="gsm8k",
    )
    # -I: neither the working directory nor PYTHONPATH on sys.path, so only the venv's install is importable
    args = [python, "-I", "-c", SCRIPT, service, TOKEN, req.model_dump_json(), ",".join(SERVER_ONLY)]
    got = json.loads(run(args, timeout=120, cwd=tmp_path))

    assert got["installed"] == [] and got["imported"] == []
    # the public surface (rollout_farm, rollout_farm.protocol) pulls in only the client and the wire models
    assert {".".join(m.split(".")[:3]) for m in got["ours"]} == {
        "rollout_farm",
        "rollout_farm.protocol",
        "rollout_farm.services",
        "rollout_farm.services.client",
        "rollout_farm.services.protocol",
    }  # no rollout_farm.services.config.settings
    assert Path(got["client"]).resolve().is_relative_to((tmp_path / "venv").resolve())  # not the checkout's copy
    light = P.RolloutResponse.model_validate(got["response"])
    samples = [s for g in light.groups for s in g.samples]
    assert len(samples) == 4 and all(s.token_ids and len(s.logprobs) == len(s.token_ids) for s in samples)
    assert all(p <= 0.0 for s in samples for p in s.logprobs)
    full = client.rollouts(req)  # greedy: the same tokens as the full install's client
    assert tokens(light) == tokens(full)
