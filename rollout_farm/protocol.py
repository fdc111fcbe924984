"""The wire models of the rollout service, re-exported from `rollout_farm.services.protocol`, which owns them.

`from rollout_farm.protocol import RolloutRequest, SamplingParams, Prompt`; the session and episode models are the
attributes `sessions` and `episodes` (`from rollout_farm.protocol import sessions as S`).
"""

from rollout_farm.services.protocol import *  # noqa: F403  (the owner's __all__ is the surface)
from rollout_farm.services.protocol import __all__ as _owned
from rollout_farm.services.protocol import episodes, sessions

__all__ = [*_owned, "episodes", "sessions"]
