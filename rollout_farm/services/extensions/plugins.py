"""User code named in FARM_PLUGINS: modules imported at start-up so that their registrations run (samplers,
rewards, engines), and the only modules a request or setting may name by dotted path."""

from __future__ import annotations

import importlib

from rollout_farm.services.config.settings import ServiceSettings


def load_plugins(settings: ServiceSettings) -> None:
    for module in settings.plugins:
        importlib.import_module(module)
