"""Constraints for installing rollout-farm into an image that already holds a stack (the SGLang base image), and the
check that the install broke nothing there. deploy/Dockerfile.gpu runs it three times:

    python3 deploy/constraints.py --installed > /tmp/base-constraints.txt   # the base's own packages, name==version
    python3 deploy/constraints.py requirements.lock > /tmp/lock-constraints.txt  # the lock, less the base's packages
    python3 -m pip check > base-pip-check.txt || true                          # (before the install)
    python3 deploy/constraints.py --check base-pip-check.txt                  # (after it): no new broken requirement

`--installed` is the base's `pip freeze` as constraints: every installed distribution pinned at its version, so
nothing the base ships (torch, transformers, SGLang and what they need) can move. It reads package metadata rather
than pip freeze's output because freeze writes an editable install (SGLang's image installs SGLang with `pip install
-e`) as `-e <path or VCS URL>`, which pip refuses as a constraint.
"""

from __future__ import annotations

import re
import subprocess
import sys
from importlib import metadata

# The base image's packages that the install may move to the lock's version, each with the reason; every other one
# stays at the base's version. pip refused `.[server,trainer]` under the full pins of a dry-run resolution of what
# SGLang 0.5.14's image installs (sglang[all]), and accepted it with these released; every requirement on them in
# that resolved base accepts the lock's versions (docs/deploy.md, "The images").
RELEASED = {
    "packaging": "verl 0.9.1 needs tensordict<=0.10.0, whose pyvers 0.1.0 caps packaging<26; SGLang's stack takes 25.0",
    "omegaconf": "verl 0.9.1 needs hydra-core 1.3, which caps omegaconf<2.4; SGLang's [diffusion] stack takes 2.3",
}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def lock_without(lock_lines: list[str], installed: set[str]) -> list[str]:
    """The lock's `name==version` lines whose package is not in `installed` (canonical names), or is RELEASED."""
    installed = set(installed) - set(RELEASED)
    kept = []
    for line in lock_lines:
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if canonical(re.split(r"[=<>!~\[; ]", line, maxsplit=1)[0]) not in installed:
            kept.append(line)
    return kept


def valid_version(version: str) -> bool:
    """A version pip accepts in `name==version` (PEP 440); packaging's parser where the image has it."""
    try:
        from packaging.version import InvalidVersion, Version
    except ImportError:  # no packaging here: let pip judge (it names the line it cannot read)
        return True
    try:
        Version(version)
    except InvalidVersion:
        return False
    return True


def installed_pins(dists) -> tuple[list[str], list[str]]:
    """`name==version` for each distribution, the first of a name on sys.path (the one Python imports and pip
    sees), sorted, less RELEASED; and the ones left out because pip could not read their version as a constraint."""
    pins, skipped, seen = {}, [], set()
    for dist in dists:
        name = dist.metadata["Name"]
        if not name or canonical(name) in seen or canonical(name) in RELEASED:
            continue
        seen.add(canonical(name))
        if valid_version(dist.version):
            pins[canonical(name)] = f"{name}=={dist.version}"
        else:
            skipped.append(f"{name} {dist.version}")
    return [pins[k] for k in sorted(pins)], skipped


def new_problems(before: list[str], after: list[str]) -> list[str]:
    """`pip check` lines present after the install and not before it: what the install broke. A base image may ship
    with broken requirements of its own (SGLang's CUDA 13 images have replaced torch under an exact pin before)."""
    known = {line.strip() for line in before}
    return [line.strip() for line in after if line.strip() and line.strip() not in known and "No broken" not in line]


def main(argv: list[str]) -> int:
    if argv[:1] == ["--installed"]:
        pins, skipped = installed_pins(metadata.distributions())
        for s in skipped:
            print(f"constraints: not pinned (its version is not PEP 440): {s}", file=sys.stderr)
        print("\n".join(pins))
        return 0
    if argv[:1] == ["--check"] and len(argv) == 2:
        with open(argv[1]) as f:
            before = f.readlines()
        done = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True)
        if before and any(line.strip() and "No broken" not in line for line in before):
            print("pip check: the base image's own broken requirements, left as they are:\n" + "".join(before))
        broken = new_problems(before, done.stdout.splitlines())
        if broken:
            print("pip check: the install broke requirements:\n" + "\n".join(broken), file=sys.stderr)
            return 1
        print("pip check: nothing broken by the install")
        return 0
    if len(argv) == 1 and not argv[0].startswith("-"):
        installed = {canonical(d.metadata["Name"]) for d in metadata.distributions() if d.metadata["Name"]}
        with open(argv[0]) as f:
            print("\n".join(lock_without(f.readlines(), installed)))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
