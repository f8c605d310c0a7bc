"""Option values the subcommands share, parsed one way: comma-separated ints, names, layouts.

Each parser raises ValueError naming the flag and the text it could not read (the CLI prints
it as one line, exit code 2).
"""

from __future__ import annotations

from moeshard.parallel.config import ParallelConfig


def ints(text: str, flag: str) -> tuple[int, ...]:
    """``"1,16, 64"`` -> ``(1, 16, 64)``; empty entries are skipped."""
    try:
        return tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise ValueError(f"{flag}: {text!r} is not a comma-separated list of integers") from None


def names(text: str | None) -> tuple[str, ...] | None:
    """``"a, b"`` -> ``("a", "b")``; None (the option not given) stays None."""
    return None if text is None else tuple(v.strip() for v in text.split(",") if v.strip())


def layouts(text: str, flag: str = "--layouts") -> tuple[ParallelConfig, ...]:
    """``"dp2-tp2-ep,dp1-tp2-noep"`` (commas) or ``"2,2,on;1,2,off"`` (semicolons) -> layouts,
    each read by ``ParallelConfig.parse``."""
    named = text.strip().lower().startswith("dp") and ";" not in text
    try:
        return tuple(ParallelConfig.parse(t) for t in text.split("," if named else ";") if t.strip())
    except ValueError as exc:
        raise ValueError(f"{flag}: {exc}") from None
