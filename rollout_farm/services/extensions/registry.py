"""One small registry type for every extension point: samplers, rewards, engines, tasks, advantage estimators.

A name can be registered once; a lookup of an unknown name lists the valid ones;
`pkg.module:attr` loads user code without forking the project. A registry of classes checks that what a
dotted path names is a subclass of its base.
"""

from __future__ import annotations

import importlib
from typing import Callable, Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, kind: str, base: type | None = None):
        self.kind, self.base = kind, base
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
        """A registered name, or `pkg.module:attr`; with `modules`, only from those modules (names that come from
        requests or settings). KeyError, listing the valid names, for anything else."""
        if name in self._items:
            return self._items[name]
        module, sep, attr = name.partition(":")
        if sep and (modules is None or module in modules):
            found = getattr(importlib.import_module(module), attr, None)
            if (
                self.base is not None
                and found is not None
                and not (isinstance(found, type) and issubclass(found, self.base))
            ):
                raise KeyError(f"{name!r} is not a {self.base.__name__} subclass")
            if found is not None:
                return found
        where = "'pkg.module:attr' with the module in FARM_PLUGINS" if modules is not None else "'pkg.module:attr'"
        raise KeyError(f"unknown {self.kind} {name!r}; valid names: {', '.join(self.names())}, or {where}")
