"""NaN and Inf in what a command reports: found, refused, or written as JSON ``null`` with the
reason, and never as the ``NaN`` / ``Infinity`` tokens that ``json.dumps`` writes by default
(they are not JSON: strict readers, JavaScript's ``JSON.parse`` or ``jq``, refuse the whole file).

    nonfinite_fields(data)             where a result (dicts, lists, floats) holds NaN or Inf:
                                       [("records[3].ms", "NaN"), ...]
    with_nulls(data)                   a copy with each of them None, and a top-level
                                       ``"nonfinite"`` list naming each field and its value
    refuse_nonfinite(data, what, ...)  for figures whose NaN/Inf means a broken result (eplb,
                                       bench): ``NonFiniteOutput`` (exit code 7), nothing written,
                                       unless allowed (``--allow-nonfinite``): then ``with_nulls``
    json_text(data)                    the JSON text, strict (a NaN left in it is a bug: RuntimeError)
"""

from __future__ import annotations

import json
import math
from typing import Any

from moeshard.errors import NonFiniteOutput

NONFINITE_KEY = "nonfinite"  # the top-level list that says why a null stands where a number was
_SHOWN = 3  # fields named in a refusal


def _spelled(value: float) -> str:
    return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")


def nonfinite_fields(data: Any, path: str = "") -> list[tuple[str, str]]:
    """(field path, ``"NaN"`` / ``"Infinity"`` / ``"-Infinity"``) for every float of ``data``
    that is not finite; paths read ``records[3].ratios.vs_peak`` (keys joined by dots, list
    indices in brackets)."""
    if isinstance(data, float):
        return [] if math.isfinite(data) else [(path, _spelled(data))]
    if isinstance(data, dict):
        return [f for key, value in data.items() for f in nonfinite_fields(value, f"{path}.{key}" if path else str(key))]
    if isinstance(data, (list, tuple)):
        return [f for i, value in enumerate(data) for f in nonfinite_fields(value, f"{path}[{i}]")]
    return []


def _nulled(data: Any) -> Any:
    if isinstance(data, float):
        return data if math.isfinite(data) else None
    if isinstance(data, dict):
        return {key: _nulled(value) for key, value in data.items()}
    if isinstance(data, (list, tuple)):
        return [_nulled(value) for value in data]
    return data


def with_nulls(data: dict) -> dict:
    """``data`` with every NaN/Inf float replaced by None; when there was one, the top-level
    ``"nonfinite"`` lists each as ``{"field": "records[3].ms", "value": "NaN"}``, so that a
    reader knows why a null stands there. ``data`` itself, untouched, when all is finite."""
    found = nonfinite_fields(data)
    if not found:
        return data
    out = _nulled(data)
    out[NONFINITE_KEY] = [{"field": field, "value": value} for field, value in found]
    return out


def refuse_nonfinite(data: dict, what: str, allow: bool, flag: str = "--allow-nonfinite") -> dict:
    """For figures in which a NaN/Inf means the result is broken: ``data`` when all is finite;
    else ``NonFiniteOutput`` (exit code 7) naming the first fields, or, with ``allow``, the copy
    ``with_nulls`` makes (to be written; print the original, whose NaN reads as nan)."""
    found = nonfinite_fields(data)
    if not found:
        return data
    if not allow:
        shown = ", ".join(f"{field} = {value}" for field, value in found[:_SHOWN])
        more = f" and {len(found) - _SHOWN} more" if len(found) > _SHOWN else ""
        raise NonFiniteOutput(f"{what} hold {len(found)} NaN/Inf value(s) ({shown}{more}): a broken result, nothing "
                              f"written ({flag} writes them as null, listed under \"{NONFINITE_KEY}\")")
    return with_nulls(data)


def json_text(data: Any, indent: int = 1) -> str:
    """``data`` as JSON text (and a newline). A NaN/Inf left in it is a bug of the caller, which
    must pass the data through ``with_nulls`` or ``refuse_nonfinite`` first: RuntimeError."""
    try:
        return json.dumps(data, indent=indent, allow_nan=False) + "\n"
    except ValueError as exc:  # not a refusal of the user's input: keep the traceback
        raise RuntimeError(f"json_text: {exc} (at {[f for f, _ in nonfinite_fields(data)][:_SHOWN]})") from exc
