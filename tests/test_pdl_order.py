"""The kernels launched under programmatic dependent launch wait before they touch memory.

A kernel launched with PDL that reads before its ``griddepcontrol.wait`` reads what the kernel ahead
has not finished writing: on the GPU its results then differ from run to run, and no CPU test of
the interpreted kernels can see it (the interpreter has no PDL). ``quantize_h`` once shipped without
its wait, and the GPU test ``test_pdl_gives_the_same_bits`` found it only on a lent GPU. This test
compiles every such kernel for Hopper on the CPU (``scripts/pdl_order.py``) and reads the order in
its machine code, so that the same fault fails here, on any machine with Triton's CUDA tools.
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

import pytest
from cuda_tools import cuda_tools_missing, run_compile_script

ROOT = Path(__file__).resolve().parents[1]
KERNELS = ROOT / "src" / "moeshard" / "kernels"


def pdl_kernels() -> set[str]:
    """Names of the @triton.jit kernels under src/moeshard/kernels that take a ``PDL`` constexpr
    (the helpers of ``pdl.py`` itself aside)."""
    names = set()
    for path in KERNELS.glob("*.py"):
        if path.name == "pdl.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and any("jit" in ast.unparse(d) for d in node.decorator_list) \
                    and any(a.arg == "PDL" for a in node.args.args):
                names.add(node.name)
    return names


def test_every_pdl_kernel_waits_before_it_touches_memory(tmp_path):
    reason = cuda_tools_missing()
    if reason:
        pytest.skip(reason)
    out = tmp_path / "order.json"
    run = run_compile_script("pdl_order.py", out, tmp_path)
    assert out.exists(), f"scripts/pdl_order.py wrote nothing (rc {run.returncode}):\n{run.stdout}\n{run.stderr[-3000:]}"
    rows = json.loads(out.read_text())["kernels"]
    broken = [r for r in rows if not r["ok"]]
    assert not broken, f"kernels that touch memory, exit or signal before their wait: {broken}"
    assert run.returncode == 0, run.stdout
    # Every kernel that takes PDL is checked, so a new one cannot skip the check.
    assert {r["function"] for r in rows} == pdl_kernels()


def _sass(*ops: str) -> str:
    """Hand-made SASS: one instruction a line, as cuobjdump prints them."""
    return "\n".join(f"        /*{16 * i:04x}*/                   {op} ;" for i, op in enumerate(ops))


def test_the_order_check_itself_on_hand_made_machine_code():
    """``order`` on SASS whose verdict is known: a load before the wait breaks the contract unless
    the kernel is allowed that many early loads (the prefetching down GEMM's one read of its plan),
    and then L2 prefetches pass too; a store before the wait, or one load too many, still break it."""
    sys.path.insert(0, str(ROOT / "scripts"))
    pdl_order = pytest.importorskip("pdl_order")
    order = pdl_order.order
    assert order(_sass("ACQBULK", "LDG.E.64 R2, desc[UR4][R2.64]", "PREEXIT", "EXIT"))["ok"]
    early = _sass("LDG.E.64 R2, desc[UR4][R2.64]", "UBLKPF.L2 [UR14], UR12", "ACQBULK", "PREEXIT", "EXIT")
    assert not order(early)["ok"] and order(early, early_loads=1)["ok"]
    assert not order(_sass("LDG.E.64 R2", "LDG.E R4", "ACQBULK", "EXIT"), early_loads=1)["ok"]
    assert not order(_sass("LDG.E.64 R2", "STG.E [R2], R4", "ACQBULK", "EXIT"), early_loads=1)["ok"]
    assert not order(_sass("UBLKPF.L2 [UR14], UR12", "ACQBULK", "EXIT"))["ok"]
    assert not order(_sass("LDG.E.64 R2", "EXIT", "ACQBULK"), early_loads=1)["ok"]
