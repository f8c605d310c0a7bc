"""Integer checks, written once: an int that is not a bool, in a range, or a ValueError.

Every helper returns the value it was given when it passes, and otherwise raises ValueError
``"<where>.<name>: must be <what>, got <value!r>"`` (``where``: the class or function that
refuses, ``name``: the field or argument), the spelling ``MoEConfig`` and ``ParallelConfig`` use.
``bool`` is refused everywhere: ``True`` is an ``int`` to Python but never a count or a rank.
"""

from __future__ import annotations

from typing import Any


def is_int(value: Any) -> bool:
    """Whether ``value`` is an ``int`` and not a ``bool`` (for checks with messages of their own)."""
    return isinstance(value, int) and not isinstance(value, bool)


def int_at_least(where: str, name: str, value: Any, minimum: int) -> int:
    """``value`` if it is an int >= ``minimum``, else ValueError "... must be an integer >= minimum"."""
    if not is_int(value) or value < minimum:
        raise ValueError(f"{where}.{name}: must be an integer >= {minimum}, got {value!r}")
    return value


def positive_int(where: str, name: str, value: Any) -> int:
    """``value`` if it is an int >= 1, else ValueError "... must be a positive integer"."""
    if not is_int(value) or value <= 0:
        raise ValueError(f"{where}.{name}: must be a positive integer, got {value!r}")
    return value


def nonneg_int(where: str, name: str, value: Any) -> int:
    """``value`` if it is an int >= 0, else ValueError "... must be an integer >= 0"."""
    return int_at_least(where, name, value, 0)


def index(where: str, name: str, value: Any, size: int) -> int:
    """``value`` if it is an int in ``[0, size)``, else ValueError "... must be an integer in [0, size)"."""
    if not is_int(value) or not 0 <= value < size:
        raise ValueError(f"{where}.{name}: must be an integer in [0, {size}), got {value!r}")
    return value
