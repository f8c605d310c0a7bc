"""Value checks, written once: ints (not bools) in a range, finite floats in a range, bools,
seeds, timeouts -- or a ValueError.

Every helper returns the value it was given when it passes (floats as ``float``), and otherwise
raises ValueError ``"<where>.<name>: must be <what>, got <value!r>"`` (``where``: the class or
function that refuses, ``name``: the field or argument), the spelling ``MoEConfig`` and
``ParallelConfig`` use. ``bool`` is refused everywhere an int or a float belongs: ``True`` is an
``int`` to Python but never a count, a rank or a scale; and only a real ``bool`` is a bool
(``"false"`` is a non-empty string, which Python would read as true).

Bounds that keep values sane (not limits of any model moeshard targets):
  * ``MAX_DIM``: the largest size of one dimension or count (2^31 - 1), so every size fits the
    int32 / int64 arithmetic of torch and of the kernels;
  * ``MAX_TIMEOUT_S``: the longest timeout (7 days), which every timedelta and socket accepts;
  * ``MAX_SEED``: the largest seed (2^63 - 2): ``torch.Generator.manual_seed`` takes int64 and
    ``moeshard run`` uses ``seed + 1`` too.
"""

from __future__ import annotations

import math
from typing import Any, TypeGuard

MAX_DIM = 2**31 - 1
MAX_TIMEOUT_S = 7 * 24 * 3600.0
MAX_SEED = 2**63 - 2


def _label(where: str, name: str) -> str:
    """``where.name``, or just ``name`` for a command-line flag (``where=""``: ``--timeout``)."""
    return f"{where}.{name}" if where else name


def is_int(value: Any) -> TypeGuard[int]:
    """Whether ``value`` is an ``int`` and not a ``bool`` (for checks with messages of their own)."""
    return isinstance(value, int) and not isinstance(value, bool)


def int_at_least(where: str, name: str, value: Any, minimum: int) -> int:
    """``value`` if it is an int >= ``minimum``, else ValueError "... must be an integer >= minimum"."""
    if not is_int(value) or value < minimum:
        raise ValueError(f"{_label(where, name)}: must be an integer >= {minimum}, got {value!r}")
    return value


def positive_int(where: str, name: str, value: Any) -> int:
    """``value`` if it is an int >= 1, else ValueError "... must be a positive integer"."""
    if not is_int(value) or value <= 0:
        raise ValueError(f"{_label(where, name)}: must be a positive integer, got {value!r}")
    return value


def nonneg_int(where: str, name: str, value: Any) -> int:
    """``value`` if it is an int >= 0, else ValueError "... must be an integer >= 0"."""
    return int_at_least(where, name, value, 0)


def int_in_range(where: str, name: str, value: Any, minimum: int, maximum: int) -> int:
    """``value`` if it is an int in ``[minimum, maximum]``, else ValueError naming the range."""
    if not is_int(value) or not minimum <= value <= maximum:
        raise ValueError(f"{_label(where, name)}: must be an integer in [{minimum}, {maximum}], got {value!r}")
    return value


def size(where: str, name: str, value: Any, minimum: int = 1) -> int:
    """A dimension or count: an int in ``[minimum, MAX_DIM]`` (``minimum`` 1, or 0 for optional counts)."""
    if is_int(value) and value > MAX_DIM:
        raise ValueError(f"{_label(where, name)}: must be at most {MAX_DIM}, got {value!r}")
    return positive_int(where, name, value) if minimum == 1 else int_at_least(where, name, value, minimum)


def boolean(where: str, name: str, value: Any) -> bool:
    """``value`` if it is a ``bool`` (not 0/1, not ``"false"``), else ValueError "... must be a bool"."""
    if not isinstance(value, bool):
        raise ValueError(f"{_label(where, name)}: must be a bool, got {value!r}")
    return value


def finite_float(where: str, name: str, value: Any, low: float, high: float, *, low_open: bool = False) -> float:
    """``float(value)`` if ``value`` is an int or float (not a bool), finite, and in ``[low, high]``
    (``(low, high]`` with ``low_open``); else ValueError naming the range."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if ok:
        try:
            number = float(value)
        except OverflowError:  # an int too large for a float
            ok = False
        else:
            ok = math.isfinite(number) and (number > low if low_open else number >= low) and number <= high
    if not ok:
        bracket = "(" if low_open else "["
        raise ValueError(f"{_label(where, name)}: must be a finite number in {bracket}{low:g}, {high:g}], got {value!r}")
    return number


def timeout(where: str, name: str, value: Any) -> float:
    """A timeout in seconds: finite, > 0 and at most ``MAX_TIMEOUT_S`` (``inf`` and NaN are refused:
    every wait in moeshard is bounded)."""
    return finite_float(where, name, value, 0.0, MAX_TIMEOUT_S, low_open=True)


def seed(where: str, name: str, value: Any) -> int:
    """A seed: an int in ``[0, MAX_SEED]``."""
    return int_in_range(where, name, value, 0, MAX_SEED)


def index(where: str, name: str, value: Any, size: int) -> int:
    """``value`` if it is an int in ``[0, size)``, else ValueError "... must be an integer in [0, size)"."""
    if not is_int(value) or not 0 <= value < size:
        raise ValueError(f"{_label(where, name)}: must be an integer in [0, {size}), got {value!r}")
    return value
