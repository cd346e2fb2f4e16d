"""One small registry per family of interchangeable parts (attention, feed-forward, norm).

Implementations are chosen by the string in the config; this is the only place that maps a name
to a class, so there are no `if kind == ...` chains elsewhere.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from typing import Generic, TypeVar

from attnlab.errors import ConfigError

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, family: str) -> None:
        self.family = family
        self._entries: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def add(entry: T) -> T:
            if name in self._entries:
                raise ValueError(f"{self.family} '{name}' registered twice")
            self._entries[name] = entry
            return entry

        return add

    def get(self, name: str) -> T:
        if name not in self._entries:
            near = difflib.get_close_matches(name, list(self._entries), n=1)
            hint = f" Did you mean '{near[0]}'?" if near else ""
            raise ConfigError(f"unknown {self.family} '{name}'.{hint} Known: {', '.join(self.names())}")
        return self._entries[name]

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries


ATTENTION: Registry = Registry("attention")
FEED_FORWARD: Registry = Registry("feed-forward")
NORM: Registry = Registry("norm")
