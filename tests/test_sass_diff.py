"""``scripts/sass_diff.py``'s verdicts, on hand-made compilations: the same tile choices and
opcodes pass; a reordering of the same opcodes passes, named as such; another opcode, a choice
that differs, or a kernel only one code compiled fails. (Compiling for sm_90a is what the script
itself does; its output for the fp8 benches' shapes is in results/cpu/.)"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import sass_diff  # noqa: E402


def _code(configs=None, sass=None):
    return {"configs": configs or {"m T=1 none": "ExpertsConfig(engine='triton')"},
            "sass": sass or {"bf16 gate_up": ["LDC", "ULDC", "HGMMA", "STG", "EXIT"]}}


def test_the_same_code_passes():
    lines, same = sass_diff.compare(_code(), _code())
    assert same and "the same instructions in the same order" in lines[-1]
    assert lines[0] == "1 tile choices compared; engines chosen: ['triton']"


def test_a_reordering_of_the_same_opcodes_passes_and_is_named():
    lines, same = sass_diff.compare(_code(), _code(sass={"bf16 gate_up": ["ULDC", "LDC", "HGMMA", "STG", "EXIT"]}))
    assert same and "a few in another order" in lines[-1]


def test_another_opcode_a_choice_or_a_kernel_of_one_code_fails():
    lines, same = sass_diff.compare(_code(), _code(sass={"bf16 gate_up": ["LDC", "ULDC", "HGMMA", "LDL", "STG", "EXIT"]}))
    assert not same and "DIFFERENT: {'LDL': 1}" in lines[-1]
    lines, same = sass_diff.compare(_code(), _code(configs={"m T=1 none": "ExpertsConfig(engine='gluon')"}))
    assert not same and lines[0].startswith("choice differs: m T=1 none")
    lines, same = sass_diff.compare(_code(), _code(sass={"bf16 down": ["EXIT"]}))
    assert not same and any("compiled by the base code only" in line for line in lines)
    assert any("compiled by the new code only" in line for line in lines)
