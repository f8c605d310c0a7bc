"""Whether Triton can be imported here: the one probe that the kernels and the dispatch backends'
CUDA combine pass both read (importing ``triton`` can fail in many ways on a broken build)."""

from __future__ import annotations

import functools
import importlib.util


@functools.cache
def triton_importable() -> tuple[bool, str]:
    """(ok, reason): whether ``import triton`` works in this environment."""
    if importlib.util.find_spec("triton") is None:
        return False, "triton is not installed"
    try:
        import triton.language  # noqa: F401  (imports triton itself too)
    except Exception as exc:  # an incompatible build raises all sorts of errors at import
        return False, f"import triton failed: {type(exc).__name__}: {exc}"
    return True, ""
