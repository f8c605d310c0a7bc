"""Whether Triton can compile for Hopper (sm_90a) on this machine, for the tests that read
compiled kernels' machine code without a GPU."""

from __future__ import annotations

from pathlib import Path


def cuda_tools_missing() -> str | None:
    """Why Triton cannot compile for sm_90 here, or None when it can."""
    try:
        import triton
    except Exception as exc:  # noqa: BLE001 (any broken install is a reason to skip)
        return f"triton does not import: {exc}"
    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    missing = [t for t in ("ptxas", "cuobjdump") if not (bin_dir / t).exists()]
    return f"Triton's CUDA tools are missing: {missing} in {bin_dir}" if missing else None
