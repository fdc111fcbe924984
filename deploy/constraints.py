"""Constraints for installing rollout-farm into an image that already holds a stack (the SGLang base image):
requirements.lock, less every package the image has installed, so the base's pins (torch, transformers, SGLang's
own) win and the lock pins the rest.

    python deploy/constraints.py requirements.lock > /tmp/constraints.txt
"""

from __future__ import annotations

import re
import sys
from importlib import metadata


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def lock_without(lock_lines: list[str], installed: set[str]) -> list[str]:
    """The lock's `name==version` lines whose package is not in `installed` (canonical names)."""
    kept = []
    for line in lock_lines:
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if canonical(re.split(r"[=<>!~\[; ]", line, maxsplit=1)[0]) not in installed:
            kept.append(line)
    return kept


if __name__ == "__main__":
    installed = {canonical(d.metadata["Name"]) for d in metadata.distributions() if d.metadata["Name"]}
    with open(sys.argv[1]) as f:
        print("\n".join(lock_without(f.readlines(), installed)))
