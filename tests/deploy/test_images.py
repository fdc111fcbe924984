"""The two images' Dockerfiles, without building them (no Docker engine here): hadolint, what they install from,
who they run as, their health check, and the helper scripts they copy in."""

import fnmatch
import re
import shutil
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import tomllib

from deploy import constraints

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = [ROOT / "deploy/Dockerfile", ROOT / "deploy/Dockerfile.gpu"]
HADOLINT = shutil.which("hadolint", path=str(Path(sys.executable).parent))


def lock_pin(name: str) -> str:
    return re.search(rf"^{name}==([^\s+]+)", (ROOT / "requirements.lock").read_text(), re.M).group(1)


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
    assert '-c requirements.lock ".[trainer]"' in text and "farm build-model" in text


def test_the_gpu_image_is_the_sglang_the_extra_pins():
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["sglang"]
    pinned = next(re.search(r"sglang\[srt\]==(\S+)", d).group(1) for d in extra if d.startswith("sglang"))
    text = DOCKERFILES[1].read_text()
    assert f"ARG SGLANG_VERSION={pinned}" in text and "FROM lmsysorg/sglang:v${SGLANG_VERSION}-" in text


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
