"""A name -> descriptor registry, the one mechanism behind the schemes, activation kinds and
routing kinds (each module keeps its own checks of what it registers)."""

from __future__ import annotations

from collections.abc import ItemsView, ValuesView
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Descriptors by name, in registration order."""

    def __init__(self) -> None:
        self._items: dict[str, T] = {}

    def add(self, name: str, item: T) -> T:
        self._items[name] = item
        return item

    def remove(self, name: str) -> None:
        """Removes ``name`` if registered (tests that register their own clean up with this)."""
        self._items.pop(name, None)

    def names(self) -> tuple[str, ...]:
        return tuple(self._items)

    def lookup(self, name: object) -> T | None:
        """The descriptor of ``name``, or None (also for a name that is not a string)."""
        return self._items.get(name) if isinstance(name, str) else None

    def get(self, name: object, where: str) -> T:
        """The descriptor of ``name``; ValueError naming ``where``, the value and the known names."""
        item = self.lookup(name)
        if item is None:
            raise ValueError(f"{where}: {name!r} is not one of {list(self._items)}")
        return item

    def values(self) -> ValuesView[T]:
        return self._items.values()

    def items(self) -> ItemsView[str, T]:
        return self._items.items()

    def __contains__(self, name: object) -> bool:
        return self.lookup(name) is not None
