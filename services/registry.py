"""One small registry type for every extension point (rewards, engines, estimators).

A name can be registered once; a lookup of an unknown name lists the valid ones;
`pkg.module:attr` loads user code without forking the project.
"""

from __future__ import annotations

import importlib
from typing import Callable, Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, kind: str):
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def deco(obj: T) -> T:
            if name in self._items:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._items[name] = obj
            return obj

        return deco

    def names(self) -> list[str]:
        return sorted(self._items)

    def get(self, name: str, modules: list[str] | None = None) -> T:
        """A registered name, or `pkg.module:attr`; with `modules`, only from those modules (names that come from requests)."""
        if name in self._items:
            return self._items[name]
        module, sep, attr = name.partition(":")
        if sep and (modules is None or module in modules):
            found = getattr(importlib.import_module(module), attr, None)
            if found is not None:
                return found
        where = "'pkg.module:attr' with the module in FARM_PLUGINS" if modules is not None else "'pkg.module:attr'"
        raise KeyError(f"unknown {self.kind} {name!r}; valid names: {', '.join(self.names())}, or {where}")
