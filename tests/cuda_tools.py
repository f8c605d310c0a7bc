"""Whether Triton can compile for Hopper (sm_90a) on this machine, for the tests that read
compiled kernels' machine code without a GPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def cuda_tools_missing() -> str | None:
    """Why Triton cannot compile for sm_90 here, or None when it can."""
    try:
        import triton
    except Exception as exc:  # noqa: BLE001 (any broken install is a reason to skip)
        return f"triton does not import: {exc}"
    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    missing = [t for t in ("ptxas", "cuobjdump") if not (bin_dir / t).exists()]
    return f"Triton's CUDA tools are missing: {missing} in {bin_dir}" if missing else None


def run_compile_script(script: str, out: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    """Runs ``scripts/<script> --json out`` in its own process, compiling (not interpreting) the
    kernels with a Triton cache of its own: the interpreted kernels of other tests patch Triton's
    language in the test process."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT / "src")
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    return subprocess.run([sys.executable, str(ROOT / "scripts" / script), "--json", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
