"""One generate call as the torch engine's scheduler (scheduler.py) holds it, from its arrival to its outputs."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import torch

from rollout_farm.services.engine.base import EngineOutput
from rollout_farm.services.engine.torch.sampling import RegexMask
from rollout_farm.services.protocol import SamplingParams


class Call:
    """One generate call: its prompts and params, the caller's cancel event and future, and its outputs so far."""

    def __init__(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        cancel: threading.Event,
        urgent: bool,
        cache_key: str | None = None,
        adapter: str | None = None,
    ):
        self.prompts, self.params, self.cancel, self.urgent = prompts, params, cancel, urgent
        self.adapter = adapter  # the resident adapter its rows use (lora.py), pinned while it runs; None: the base
        self.cache_key = cache_key if len(prompts) == 1 else None  # a session's one sequence (session_cache.py)
        self.kv_version = -1  # the weight version its KV cache was computed on (with `adapter`, its policy)
        self.future: Future = Future()
        self.arrived = time.monotonic()
        self.epoch = 0  # the engine's abort epoch when the call was admitted
        self.gen: torch.Generator | None = None  # its own generator when it has a seed
        self.regex: RegexMask | None = None
        self.outputs: list[EngineOutput | None] = [None] * len(prompts)
        self.live = len(prompts)
