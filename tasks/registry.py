"""A tiny name -> object registry (in the spirit of timm's ``_registry.py``).

Pruners, healers and model sources register under stable names; the same names appear verbatim in
configs, MLflow params and reports. Registering the same name twice is a programming error.
"""
from __future__ import annotations

from typing import Callable, Generic, Iterator, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """``instances=True``: the registry holds one instance per name, and ``@REG.register(name)`` on a class
    sets ``cls.name = name``, registers ``cls()`` and returns the class (pruners, healers, adapters: stateless strategies)."""

    def __init__(self, kind: str, instances: bool = False) -> None:
        self.kind = kind
        self.instances = instances
        self._entries: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def deco(obj: T) -> T:
            if name in self._entries:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            if self.instances and isinstance(obj, type):
                obj.name = name  # the registered name is the one name of the method (configs, MLflow, reports)
                self._entries[name] = obj()
            else:
                self._entries[name] = obj
            return obj

        return deco

    def get(self, name: str) -> T:
        try:
            return self._entries[name]
        except KeyError:
            raise KeyError(
                f"unknown {self.kind} {name!r}; allowed: {', '.join(sorted(self._entries))}"
            ) from None

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())
