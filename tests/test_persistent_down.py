"""The Gluon persistent down GEMM (``moeshard.kernels.persistent_down``) without a GPU: where
``select_config`` takes it, what ``GemmConfig`` and ``moe_gemm`` refuse, and that it compiles for
Hopper (sm_90a) with the installed Triton, whose Gluon API moves between releases (the kernel's
bits against the Triton kernel's are tests/gpu's ``test_gluon_down_gives_the_triton_bits``)."""

from __future__ import annotations

import json

import pytest
import torch
from cuda_tools import cuda_tools_missing, run_compile_script

from moeshard.kernels.configs import GLUON_DOWN_MAX_K, GLUON_DOWN_MIN_K, GemmConfig, select_config

GLUON_TILE = dict(block_m=128, block_n=256, block_k=128, group_m=8, num_warps=8, num_stages=4, tma=True,
                  fp8_acc="imprecise", engine="gluon")


@pytest.mark.parametrize("scheme", ["fp8_tensor", "fp8_token"])
def test_select_config_takes_the_gluon_down_where_it_was_measured_faster(scheme):
    """Per-row fp8 prefill down GEMMs with I in [GLUON_DOWN_MIN_K, GLUON_DOWN_MAX_K] (DeepSeek-V3
    2048, Qwen3 768),
    on a GPU that runs it; not Mixtral's 14336, not fp8_block or bf16, not at decode, not without
    the GPU's support."""
    deepseek = select_config(4096 * 8, 256, 7168, 2048, scheme, gluon=True)
    qwen3 = select_config(16384 * 8, 128, 2048, 768, scheme, gluon=True)
    for cfg in (deepseek, qwen3):
        assert cfg.down == GemmConfig(**GLUON_TILE), cfg.down
        assert cfg.gate_up.engine == "triton"
    assert GLUON_DOWN_MIN_K <= 768 and 2048 <= GLUON_DOWN_MAX_K < 14336
    assert select_config(4096 * 2, 8, 4096, 14336, scheme, gluon=True).down.engine == "triton"
    # A small shared expert (64 columns, one expert of 300 rows), and a hidden size narrower
    # than the 256-column tile: not measured, and the second refused by the kernel.
    assert select_config(300, 1, 128, 64, scheme, gluon=True).down.engine == "triton"
    assert select_config(4096 * 8, 256, 128, 2048, scheme, gluon=True).down.engine == "triton"
    assert select_config(4096 * 8, 256, 7168, 2048, scheme, gluon=False).down.engine == "triton"
    assert select_config(16, 256, 7168, 2048, scheme, gluon=True).down.engine == "triton"
    for other in ("none", "fp8_block", "nvfp4"):
        assert select_config(4096 * 8, 256, 7168, 2048, other, gluon=True).down.engine == "triton", other
    exact = select_config(4096 * 8, 256, 7168, 2048, scheme, fp8_gate_up="exact", gluon=True)
    assert exact.down.engine == "triton"  # split accumulation: not the Gluon kernel's


def test_gemm_config_refuses_what_the_gluon_engine_does_not_compute():
    GemmConfig(**GLUON_TILE)
    with pytest.raises(ValueError, match=r"GemmConfig.engine: 'cutlass' is not one of \['triton', 'gluon'\]"):
        GemmConfig(128, 256, 128, engine="cutlass")
    for change in (dict(block_n=128), dict(num_warps=4), dict(fp8_acc="split"), dict(half_tiles=True),
                   dict(num_stages=1)):
        with pytest.raises(ValueError, match="engine 'gluon' computes 128 x 256 x 128 tiles with 8 warps"):
            GemmConfig(**{**GLUON_TILE, **change})


def test_moe_gemm_refuses_options_of_the_triton_kernel_for_the_gluon_engine():
    """Each option the Gluon kernel does not take is named; off the GPU it says which device it
    needs (both before anything is launched)."""
    from moeshard.kernels.align import align_rows
    from moeshard.kernels.grouped_gemm import moe_gemm
    from moeshard.quant import quantize_activations, quantize_weight

    E, H, I, M = 2, 256, 256, 8
    w = quantize_weight(torch.randn(E, 2 * I, H), "fp8_token")
    x = quantize_activations(torch.randn(M, H), "fp8_token")
    plan = align_rows(torch.zeros(M, dtype=torch.long), E, 128)
    with pytest.raises(ValueError, match=r"engine 'gluon' .* does not take \['activation', 'gather'\]"):
        moe_gemm(x, w, plan, torch.empty(plan.padded_rows, I), GemmConfig(**GLUON_TILE), activation="silu",
                 gather=True)
    h = quantize_activations(torch.randn(plan.padded_rows, I), "fp8_token")
    down = quantize_weight(torch.randn(E, H, I), "fp8_token")
    with pytest.raises(ValueError, match="needs a CUDA device of compute capability 9.x, got cpu"):
        moe_gemm(h, down, plan, torch.empty(M, H), GemmConfig(**GLUON_TILE), activation=None, gather=False)


def test_the_gluon_down_compiles_for_hopper(tmp_path):
    """Compiled for sm_90a with the installed Triton (``scripts/gluon_resources.py``, in its own
    process: the interpreted kernels of other tests patch Triton's language in this one): fp8
    warpgroup MMAs (QGMMA), TMA loads (UTMALDG), no local-memory spills, and the ring of loads
    plus the store's staging within Hopper's 227 KB of shared memory at every stage count."""
    reason = cuda_tools_missing()
    if reason:
        pytest.skip(reason)
    pytest.importorskip("triton.experimental.gluon")
    out = tmp_path / "gluon.json"
    run = run_compile_script("gluon_resources.py", out, tmp_path)
    assert out.exists(), f"scripts/gluon_resources.py wrote nothing (rc {run.returncode}):\n{run.stderr[-3000:]}"
    rows = json.loads(out.read_text())["kernels"]
    assert [r["stages"] for r in rows] == [2, 3, 4]
    for r in rows:
        assert r["QGMMA"] and r["UTMALDG"], r
        assert r["spill_loads"] == r["spill_stores"] == 0, r
        assert r["shared"] <= 227 * 1024, r
