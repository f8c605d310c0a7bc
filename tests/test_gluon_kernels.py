"""The Gluon GEMMs (``moeshard.kernels.persistent_down``, ``moeshard.kernels.persistent_gate_up``)
without a GPU: where ``select_config`` takes them, what ``GemmConfig`` and ``moe_gemm`` refuse, and
that they compile for Hopper (sm_90a) with the installed Triton, whose Gluon API moves between
releases (their bits against the Triton kernel's are tests/gpu's
``test_gluon_down_gives_the_triton_bits`` and ``test_gluon_gate_up_gives_the_triton_bits``)."""

from __future__ import annotations

import json

import pytest
import torch
from cuda_tools import cuda_tools_missing, run_compile_script

from moeshard.kernels.configs import (
    GLUON_DOWN_MAX_K,
    GLUON_DOWN_MIN_K,
    GLUON_GATE_UP_MAX_H,
    GLUON_GATE_UP_MIN_H,
    GemmConfig,
    select_config,
)

GLUON_TILE = dict(block_m=128, block_n=256, block_k=128, group_m=8, num_warps=8, num_stages=4, tma=True,
                  fp8_acc="imprecise", engine="gluon")
GLUON_GATE_UP_TILE = {**GLUON_TILE, "block_n": 128}


@pytest.mark.parametrize("scheme", ["fp8_tensor", "fp8_token"])
def test_select_config_takes_the_gluon_down_where_it_was_measured_faster(scheme):
    """Per-row fp8 prefill down GEMMs with I in [GLUON_DOWN_MIN_K, GLUON_DOWN_MAX_K] (DeepSeek-V3
    2048, Qwen3 768),
    on a GPU that runs it; not Mixtral's 14336, not bf16 or nvfp4 (fp8_block: its own kernel), not
    at decode, not without the GPU's support."""
    deepseek = select_config(4096 * 8, 256, 7168, 2048, scheme, gluon=True)
    qwen3 = select_config(16384 * 8, 128, 2048, 768, scheme, gluon=True)
    for cfg in (deepseek, qwen3):
        assert cfg.down == GemmConfig(**GLUON_TILE), cfg.down
    assert GLUON_DOWN_MIN_K <= 768 and 2048 <= GLUON_DOWN_MAX_K < 14336
    assert select_config(4096 * 2, 8, 4096, 14336, scheme, gluon=True).down.engine == "triton"
    # A small shared expert (64 columns, one expert of 300 rows), and a hidden size narrower
    # than the 256-column tile: not measured, and the second refused by the kernel.
    assert select_config(300, 1, 128, 64, scheme, gluon=True).down.engine == "triton"
    assert select_config(4096 * 8, 256, 128, 2048, scheme, gluon=True).down.engine == "triton"
    assert select_config(4096 * 8, 256, 7168, 2048, scheme, gluon=False).down.engine == "triton"
    assert select_config(16, 256, 7168, 2048, scheme, gluon=True).down.engine == "triton"
    for other in ("none", "nvfp4"):
        assert select_config(4096 * 8, 256, 7168, 2048, other, gluon=True).down.engine == "triton", other
    # fp8_block's down is its own Gluon kernel with block scales (the test below), not this tile.
    assert select_config(4096 * 8, 256, 7168, 2048, "fp8_block", gluon=True).down != GemmConfig(**GLUON_TILE)
    exact = select_config(4096 * 8, 256, 7168, 2048, scheme, fp8_gate_up="exact", gluon=True)
    assert exact.down.engine == "triton"  # split accumulation: not the Gluon kernel's


@pytest.mark.parametrize("scheme", ["fp8_tensor", "fp8_token"])
def test_select_config_takes_the_gluon_gate_up_where_it_was_measured_faster(scheme):
    """Per-row fp8 prefill gate_up GEMMs with H in [GLUON_GATE_UP_MIN_H, GLUON_GATE_UP_MAX_H]
    (Qwen3 2048, Mixtral 4096, DeepSeek-V3 7168) at 128-4096 rows per expert, as whole tiles (the
    kernel's second MMA warpgroup skips rows of padding); not an unmeasured 512 or 8192, not
    bf16 or nvfp4, not at decode or mid batches, not without the GPU's support, not for the
    exact gate_up."""
    assert GLUON_GATE_UP_MIN_H <= 2048 and 7168 <= GLUON_GATE_UP_MAX_H < 8192
    for rows, experts, hidden, inter in ((4096 * 8, 128, 2048, 768), (16384 * 8, 128, 2048, 768),
                                         (4096 * 2, 8, 4096, 14336), (16384 * 2, 8, 4096, 14336),
                                         (4096 * 8, 256, 7168, 2048), (16384 * 8, 256, 7168, 2048)):
        cfg = select_config(rows, experts, hidden, inter, scheme, gluon=True)
        assert cfg.gate_up == GemmConfig(**GLUON_GATE_UP_TILE), cfg.gate_up
        assert select_config(rows, experts, hidden, inter, scheme, gluon=False).gate_up.engine == "triton"
        for other in ("none", "nvfp4"):
            assert select_config(rows, experts, hidden, inter, other, gluon=True).gate_up.engine == "triton", other
        exact = select_config(rows, experts, hidden, inter, scheme, fp8_gate_up="exact", gluon=True)
        assert exact.gate_up.engine == "triton"
    assert select_config(4096 * 8, 256, 8192, 2048, scheme, gluon=True).gate_up.engine == "triton"
    assert select_config(2000, 16, 512, 384, scheme, gluon=True).gate_up.engine == "triton"
    assert select_config(16, 128, 2048, 768, scheme, gluon=True).gate_up.engine == "triton"  # decode
    assert select_config(128 * 80, 128, 2048, 768, scheme, gluon=True).gate_up.engine == "triton"  # mid


def test_select_config_takes_the_gluon_gate_up_for_fp8_block_where_it_was_measured_faster():
    """fp8_block's prefill gate_up (the 128 x 128 x 128 tile) is the Gluon kernel with block
    scales at the hidden sizes measured, Qwen3's 2048, Mixtral's 4096 and DeepSeek-V3's 7168, in
    128-column tiles at 4 stages; the input is then gathered, not laid out, and h quantized by
    quantize_h's pass. Not without the GPU's support (Mixtral then keeps the layout and the
    gate_up quantizing h), not at decode or mid batches, not for an unmeasured hidden size or an
    intermediate size that is not a multiple of 128. With it, the down GEMM is the Gluon kernel
    with block scales (6 stages) at the same hidden sizes."""
    from moeshard.kernels.configs import (
        GLUON_BLOCK_DOWN_MAX_H,
        GLUON_BLOCK_DOWN_MIN_H,
        GLUON_BLOCK_GATE_UP_MAX_H,
        GLUON_BLOCK_GATE_UP_MIN_H,
    )

    tile = GemmConfig(128, 128, 128, 8, 8, 4, tma=True, fp8_acc="imprecise", engine="gluon")
    down = GemmConfig(128, 128, 128, 8, 8, 6, tma=True, fp8_acc="imprecise", engine="gluon")
    for rows, experts, hidden, inter in ((4096 * 8, 128, 2048, 768), (16384 * 8, 128, 2048, 768),
                                         (4096 * 2, 8, 4096, 14336), (16384 * 2, 8, 4096, 14336),
                                         (4096 * 8, 256, 7168, 2048), (16384 * 8, 256, 7168, 2048)):
        cfg = select_config(rows, experts, hidden, inter, "fp8_block", gluon=True)
        assert cfg.gate_up == tile and not cfg.lay_out_a and cfg.h_quant == "pass", cfg
        assert cfg.down == down, cfg.down
        off = select_config(rows, experts, hidden, inter, "fp8_block", gluon=False)
        assert off.gate_up.engine == off.down.engine == "triton"
    assert (GLUON_BLOCK_DOWN_MIN_H, GLUON_BLOCK_DOWN_MAX_H) == (2048, 7168)
    mixtral = select_config(16384 * 2, 8, 4096, 14336, "fp8_block", gluon=False)
    assert mixtral.lay_out_a and mixtral.h_quant == "gate_up"
    assert GLUON_BLOCK_GATE_UP_MIN_H == 2048 and GLUON_BLOCK_GATE_UP_MAX_H == 7168
    assert select_config(16, 256, 7168, 2048, "fp8_block", gluon=True).gate_up.engine == "triton"  # decode
    assert select_config(128 * 80, 128, 2048, 768, "fp8_block", gluon=True).gate_up.engine == "triton"  # mid
    for hidden in (1024, 8192):
        assert select_config(4096 * 8, 128, hidden, 768, "fp8_block", gluon=True).gate_up.engine == "triton", hidden
    assert select_config(4096 * 8, 128, 2048, 704, "fp8_block", gluon=True).gate_up.engine == "triton"


def test_gemm_config_refuses_what_the_gluon_engine_does_not_compute():
    GemmConfig(**GLUON_TILE)
    with pytest.raises(ValueError, match=r"GemmConfig.engine: 'cutlass' is not one of \['triton', 'gluon'\]"):
        GemmConfig(128, 256, 128, engine="cutlass")
    GemmConfig(**GLUON_GATE_UP_TILE)
    GemmConfig(**{**GLUON_GATE_UP_TILE, "block_n": 64})
    for change in (dict(block_n=32), dict(block_k=64), dict(block_m=64), dict(num_warps=4), dict(fp8_acc="split"),
                   dict(half_tiles=True), dict(num_stages=1)):
        with pytest.raises(ValueError, match="engine 'gluon' computes 128 x 64, 128 or 256 x 128 tiles"):
            GemmConfig(**{**GLUON_TILE, **change})


def test_the_gluon_gate_up_gathers_its_rows_so_the_input_is_not_laid_out():
    """``lay_out_a`` lays the input out for a gate_up that reads it by tile; with the Gluon gate_up
    the config is refused, naming both."""
    from moeshard.kernels.configs import ExpertsConfig

    gluon = GemmConfig(**{**GLUON_GATE_UP_TILE, "block_n": 64})
    down = GemmConfig(64, 128, 128, 8, 4, 3)
    ExpertsConfig(gluon, down)
    with pytest.raises(ValueError, match="ExpertsConfig.lay_out_a .* the Gluon gate_up .* gathers its rows"):
        ExpertsConfig(gluon, down, lay_out_a=True)


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
    h_out = torch.empty(plan.padded_rows, I)
    with pytest.raises(ValueError, match=r"engine 'gluon' computes the gate_up GEMM with gathered rows; it does "
                                         r"not take \['gather', 'fp8_exact', 'experts'\]"):
        moe_gemm(x, w, plan, h_out, GemmConfig(**GLUON_GATE_UP_TILE), activation="silu", gather=False,
                 fp8_exact=True, experts=(0, 2))
    with pytest.raises(ValueError, match="needs a CUDA device of compute capability 9.x, got cpu"):
        moe_gemm(x, w, plan, h_out, GemmConfig(**GLUON_GATE_UP_TILE), activation="silu", gather=True)
    # The clamped activations and expert biases are the Triton kernel's alone (TritonExperts takes
    # the Triton tiles for them).
    with pytest.raises(ValueError, match=r"computes the activation modes \(0, 1, 2\); 'swiglu_clamped' has mode 3"):
        moe_gemm(x, w, plan, h_out, GemmConfig(**GLUON_GATE_UP_TILE), activation="swiglu_clamped", gather=True)
    with pytest.raises(ValueError, match=r"does not take \['bias'\]"):
        moe_gemm(x, w, plan, h_out, GemmConfig(**GLUON_GATE_UP_TILE), activation="silu", gather=True,
                 bias=torch.zeros(E, 2 * I))
    h = quantize_activations(torch.randn(plan.padded_rows, I), "fp8_token")
    down = quantize_weight(torch.randn(E, H, I), "fp8_token")
    with pytest.raises(ValueError, match="needs a CUDA device of compute capability 9.x, got cpu"):
        moe_gemm(h, down, plan, torch.empty(M, H), GemmConfig(**GLUON_TILE), activation=None, gather=False)


def test_the_gluon_kernels_compile_for_hopper(tmp_path):
    """Compiled for sm_90a with the installed Triton (``scripts/gluon_resources.py``, in its own
    process: the interpreted kernels of other tests patch Triton's language in this one), at every
    stage count, with the ring of loads and the store's staging within Hopper's 227 KB of shared
    memory:

    * the down GEMM: fp8 warpgroup MMAs (QGMMA), TMA loads (UTMALDG), no local-memory spills with
      fp8_tensor's weight scales (one per expert), a few with fp8_token's (one per column: 19 loads
      and stores with Triton 3.9, 13 with 3.6);
    * fp8_block's warp-specialized down GEMM: the same, with registers handed between partitions;
    * the gate_up GEMM: its partitions hand registers over (USETMAXREG: the MMA warpgroups take
      more, the loader fewer), the loader's cp.async copies (LDGSTS) arrive on an mbarrier
      (ARRIVES), the weights come through TMA and the MMAs are fp8 warpgroup MMAs. It spills a few
      registers outside its K loop (10 local loads and 5 stores with Triton 3.9, 3 and 3 with
      3.6, where the study measured it); more than 32 of either would be a different kernel.
      The same with fp8_token's row maxima (``gate_up_rows``: 8 and 5 with 3.9, 2 and 2 with
      3.6).

    The per-row schemes' epilogues load their weight scales once per tile (fp8_tensor: one per
    expert) or once per thread (fp8_token: one column each, handed round by a layout
    conversion). Loading the scale of every column a thread holds costs 64 loads per thread and
    tile, with their addresses (159 global loads, LDG, in the gate_up SASS and 74 in down's);
    these kernels have 33-35 and 11."""
    reason = cuda_tools_missing()
    if reason:
        pytest.skip(reason)
    pytest.importorskip("triton.experimental.gluon")
    out = tmp_path / "gluon.json"
    run = run_compile_script("gluon_resources.py", out, tmp_path)
    assert out.exists(), f"scripts/gluon_resources.py wrote nothing (rc {run.returncode}):\n{run.stderr[-3000:]}"
    rows = json.loads(out.read_text())["kernels"]
    assert [(r["kernel"], r["stages"]) for r in rows] == [("down", 2), ("down", 3), ("down", 4), ("down_rows", 3),
                                                          ("gate_up", 3),
                                                          ("gate_up", 4), ("gate_up_rows", 3), ("gate_up_block64", 4),
                                                          ("gate_up_block64", 6), ("gate_up_block128", 3),
                                                          ("gate_up_block128", 4), ("block_down", 4), ("block_down", 6)]
    for r in rows:
        assert r["QGMMA"] and r["UTMALDG"], r
        assert r["shared"] <= 227 * 1024, r
        if r["kernel"] in ("down", "down_rows"):
            assert r["global_loads"] <= 16, r
            bound = 0 if r["kernel"] == "down" else 32
            assert r["spill_loads"] <= bound and r["spill_stores"] <= bound, r
        elif r["kernel"] == "block_down":
            # Warp-specialized, its h and weight tiles through TMA (no cp.async); no spills.
            assert r["USETMAXREG"] and r["spill_loads"] == r["spill_stores"] == 0, r
        else:
            assert r["USETMAXREG"] and r["LDGSTS"] and r["ARRIVES"], r
            # fp8_block's 128-column tile holds a third accumulator (the step's product) beside
            # gate and up: 15 spill loads and 8 stores with 3.9, 7 and 5 with 3.6.
            bound = 64 if r["kernel"] == "gate_up_block128" else 32
            assert r["spill_loads"] <= bound and r["spill_stores"] <= bound, r
            if r["kernel"] in ("gate_up", "gate_up_rows"):
                assert r["global_loads"] <= 40, r
