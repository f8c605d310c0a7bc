"""nvfp4 operands decoded once before the grouped GEMM (``kernels.nvfp4_values``,
``ExpertsConfig.decode_nvfp4``): Triton's CPU interpreter runs the kernels; tests/gpu checks the
compiled ones.

Decoding gives the same fp16 numbers the GEMM decodes in registers, so every comparison here is
bit for bit: the decoded values against the definition (e2m1 value times block scale), and the
GEMMs and experts on decoded operands against the same tiles on codes."""

from __future__ import annotations

import pytest
import torch

from moeshard.experts.base import ExpertInput, ExpertWeights
from moeshard.kernels.configs import select_config
from moeshard.quant import quantize_activations, quantize_weight
from moeshard.quant.nvfp4 import e2m1_decode, unpack_fp4


def _defined(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """e2m1 value * block scale in fp32 (exact), from the codes and scales."""
    values = e2m1_decode(unpack_fp4(data))
    return values * scale.float().repeat_interleave(16, dim=-1)


@pytest.mark.parametrize("rows,cols", [(5, 272), (33, 512), (1, 16)], ids=str)
def test_decoded_values_are_the_e2m1_values_times_their_block_scales(interpreted_kernels, exact_interpreter, rows,
                                                                       cols):
    """Activations and stacked weights, with rows and columns that are not multiples of the
    kernel's block (16 rows, 256 columns)."""
    nv = interpreted_kernels.nvfp4_values
    gen = torch.Generator().manual_seed(rows)
    x = quantize_activations(torch.randn(rows, cols, generator=gen).to(torch.bfloat16), "nvfp4")
    got = nv.nvfp4_values(x)
    assert got.values.dtype == torch.float16 and got.global_scale is x.tensor_scale
    assert torch.equal(got.values.float(), _defined(x.data, x.row_scale))
    w = quantize_weight(torch.randn(3, rows, cols, generator=gen).to(torch.bfloat16), "nvfp4")
    got_w = nv.nvfp4_values(w)
    assert got_w.values.shape == (3, rows, cols) and got_w.global_scale is w.global_scale
    assert torch.equal(got_w.values.float(), _defined(w.data, w.scale))


def test_only_nvfp4_operands_are_decoded(interpreted_kernels):
    x = quantize_activations(torch.randn(4, 128).to(torch.bfloat16), "fp8_block")
    with pytest.raises(ValueError, match="nvfp4_values: expected nvfp4 operands, got scheme 'fp8_block'"):
        interpreted_kernels.nvfp4_values.nvfp4_values(x)


def _experts(E: int, H: int, I: int, seed: int) -> ExpertWeights:
    gen = torch.Generator().manual_seed(seed)
    gu = (torch.randn(E, 2 * I, H, generator=gen) / H**0.5).to(torch.bfloat16)
    dn = (torch.randn(E, H, I, generator=gen) / I**0.5).to(torch.bfloat16)
    return ExpertWeights(quantize_weight(gu, "nvfp4"), quantize_weight(dn, "nvfp4"), "nvfp4")


@pytest.mark.parametrize("decode", ["activations", "all"])
@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "tma"])
def test_decoded_operands_give_the_codes_bits(interpreted_kernels, exact_interpreter, decode, tma):
    """gate_up (gathered, tokens repeated for their routed rows, and laid out at padded positions)
    and down on decoded activations, and on decoded weights too, against the same tiles reading
    codes: h at every used position and y bit for bit, half tiles included."""
    k = interpreted_kernels
    GemmConfig, ExpertsConfig = k.configs.GemmConfig, k.configs.ExpertsConfig
    nv = k.nvfp4_values.nvfp4_values
    E, H, I, repeat = 4, 128, 96, 2
    counts = [40, 30, 3, 17]
    ids = torch.cat([torch.full((c,), e) for e, c in enumerate(counts)])
    ids = ids[torch.randperm(ids.numel(), generator=torch.Generator().manual_seed(4))]
    w = _experts(E, H, I, seed=6)
    x = quantize_activations(torch.randn(ids.numel() // repeat, H, generator=torch.Generator().manual_seed(5))
                             .to(torch.bfloat16), "nvfp4")
    gemm = GemmConfig(32, 64, 32, group_m=2, tma=tma, half_tiles=True)
    plan = k.align.align_rows(ids, E, 32)
    used = plan.tile_expert.repeat_interleave(32) >= 0
    amax = torch.zeros(E)
    h_codes = torch.full((plan.padded_rows, I), float("nan"), dtype=torch.bfloat16)
    k.grouped_gemm.moe_gemm(x, w.gate_up, plan, h_codes, gemm, activation="silu", gather=True, amax=amax,
                            a_row_div=repeat)
    w_gu = nv(w.gate_up) if decode == "all" else w.gate_up
    for laid_out in (False, True):
        a = k.layout.lay_out_rows(nv(x), plan, repeat) if laid_out else nv(x)
        h = torch.full_like(h_codes, float("nan"))
        k.grouped_gemm.moe_gemm(a, w_gu, plan, h, gemm, activation="silu", gather=not laid_out,
                                amax=torch.zeros(E), a_row_div=1 if laid_out else repeat)
        assert not h[used].isnan().any() and torch.equal(h[used], h_codes[used]), laid_out
    h_q = k.quant.quantize_h(h_codes, "nvfp4", plan, amax)
    y_codes = k.grouped_gemm.moe_gemm(h_q, w.down, plan, torch.empty(ids.numel(), H, dtype=torch.bfloat16), gemm,
                                      activation=None, gather=False)
    w_dn = nv(w.down) if decode == "all" else w.down
    y = k.grouped_gemm.moe_gemm(nv(h_q), w_dn, plan, torch.empty_like(y_codes), gemm, activation=None, gather=False)
    assert torch.equal(y, y_codes)
    ys = [k.experts.TritonExperts("silu", torch.bfloat16, ExpertsConfig(gemm, gemm, decode_nvfp4=d))(
          ExpertInput(x, ids, repeat=repeat), w) for d in ("off", decode)]
    assert torch.equal(ys[0], ys[1])
    if decode == "all":  # the weights decoded and multiplied a window of experts at a time
        windowed = ExpertsConfig(gemm, gemm, decode_nvfp4="all", decode_experts=3)  # experts [0, 3), [3, 4)
        y_w = k.experts.TritonExperts("silu", torch.bfloat16, windowed)(ExpertInput(x, ids, repeat=repeat), w)
        assert torch.equal(y_w, ys[0])


def test_an_expert_window_computes_its_experts_rows_only(interpreted_kernels, exact_interpreter):
    """``moe_gemm(experts=(lo, hi))`` with the weights of experts [lo, hi) decoded alone: those
    experts' h positions and y rows are the whole call's bits, every other row is left as it
    was (NaN here), and windows covering every expert give the whole call's output."""
    k = interpreted_kernels
    gemm = k.configs.GemmConfig(16, 32, 32, group_m=1)
    nv = k.nvfp4_values.nvfp4_values
    E, H, I = 4, 64, 48
    ids = torch.tensor([2, 0, 3, 3, 1, 2, 2, 0, 3, 1, 3])
    w = _experts(E, H, I, seed=8)
    x = nv(quantize_activations(torch.randn(ids.numel(), H, generator=torch.Generator().manual_seed(9))
                                .to(torch.bfloat16), "nvfp4"))
    plan = k.align.align_rows(ids, E, 16)
    position_expert = plan.tile_expert.repeat_interleave(16)
    whole_h = torch.full((plan.padded_rows, I), float("nan"), dtype=torch.bfloat16)
    k.grouped_gemm.moe_gemm(x, nv(w.gate_up), plan, whole_h, gemm, activation="silu", gather=True)
    h = torch.full_like(whole_h, float("nan"))
    k.grouped_gemm.moe_gemm(x, nv(w.gate_up, (1, 3)), plan, h, gemm, activation="silu", gather=True, experts=(1, 3))
    inside = (position_expert >= 1) & (position_expert < 3)
    assert torch.equal(h[inside], whole_h[inside]) and h[~inside].isnan().all()
    h_q = nv(k.quant.quantize_h(whole_h, "nvfp4", plan, whole_h.abs().float().amax().expand(E).contiguous()))
    whole_y = k.grouped_gemm.moe_gemm(h_q, nv(w.down), plan, torch.empty(ids.numel(), H, dtype=torch.bfloat16), gemm,
                                      activation=None, gather=False)
    y = torch.full_like(whole_y, float("nan"))
    for window in ((0, 1), (3, 4)):
        k.grouped_gemm.moe_gemm(h_q, nv(w.down, window), plan, y, gemm, activation=None, gather=False, experts=window)
    outside = (ids >= 1) & (ids < 3)
    assert torch.equal(y[~outside], whole_y[~outside]) and y[outside].isnan().all()
    k.grouped_gemm.moe_gemm(h_q, nv(w.down, (1, 3)), plan, y, gemm, activation=None, gather=False, experts=(1, 3))
    assert torch.equal(y, whole_y)


def test_expert_windows_are_checked(interpreted_kernels):
    k = interpreted_kernels
    nv = k.nvfp4_values.nvfp4_values
    w = _experts(4, 64, 48, seed=10)
    with pytest.raises(ValueError, match=r"nvfp4_values: experts=\(2, 5\) is not a window 0 <= lo < hi <= E=4"):
        nv(w.gate_up, (2, 5))
    x = quantize_activations(torch.randn(3, 64).to(torch.bfloat16), "nvfp4")
    with pytest.raises(ValueError, match=r"nvfp4_values: experts=\(0, 1\) selects experts of weights"):
        nv(x, (0, 1))
    plan = k.align.align_rows(torch.tensor([0, 1, 3]), 4, 16)
    gemm = k.configs.GemmConfig(16, 32, 32, group_m=1)
    h = torch.empty(plan.padded_rows, 48, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"moe_gemm: experts=\(1, 3\) must be a window 0 <= lo < hi <= E=4 of the "
                                         r"plan's experts, with hi - lo equal to the 1 experts of w"):
        k.grouped_gemm.moe_gemm(nv(x), nv(w.gate_up, (1, 2)), plan, h, gemm, activation="silu", gather=True,
                                experts=(1, 3))
    with pytest.raises(ValueError, match=r"ExpertsConfig.decode_experts: expected an int >= 0 \(0: all experts at "
                                         r"once\), got -1"):
        k.configs.ExpertsConfig(gemm, gemm, decode_nvfp4="all", decode_experts=-1)
    with pytest.raises(ValueError, match=r"ExpertsConfig.decode_experts=4 windows the decoded weights, but "
                                         r"decode_nvfp4='activations' decodes none \(it needs 'all'\)"):
        k.configs.ExpertsConfig(gemm, gemm, decode_nvfp4="activations", decode_experts=4)


def test_decoding_is_refused_for_other_schemes_and_unknown_choices(interpreted_kernels):
    k = interpreted_kernels
    GemmConfig, ExpertsConfig = k.configs.GemmConfig, k.configs.ExpertsConfig
    gemm = GemmConfig(16, 32, 32, group_m=1)
    with pytest.raises(ValueError, match=r"ExpertsConfig.decode_nvfp4: 'weights' is not one of \['off', 'activations', 'all'\]"):
        ExpertsConfig(gemm, gemm, decode_nvfp4="weights")
    gen = torch.Generator().manual_seed(0)
    w = ExpertWeights(quantize_weight(torch.randn(2, 64, 64, generator=gen).to(torch.bfloat16), "fp8_tensor"),
                      quantize_weight(torch.randn(2, 64, 32, generator=gen).to(torch.bfloat16), "fp8_tensor"),
                      "fp8_tensor")
    x = quantize_activations(torch.randn(4, 64, generator=gen).to(torch.bfloat16), "fp8_tensor")
    with pytest.raises(ValueError, match="config.decode_nvfp4='all' decodes nvfp4 operands, but the experts are "
                                         "fp8_tensor"):
        k.experts.TritonExperts("silu", torch.bfloat16, ExpertsConfig(gemm, gemm, decode_nvfp4="all"))(
            ExpertInput(x, torch.tensor([0, 1, 1, 0])), w)


def test_prefill_decodes_the_activations_and_the_weights_read_by_several_row_tiles():
    """At prefill nvfp4 decodes its activations, and its weights where an expert holds more
    than one 128-row tile, on bf16's tiles: whole where gate_up's fp16 copy stays within 2 GiB
    (Mixtral 1.9 GB, Qwen3 0.8 GB), else in equal windows of experts that do (DeepSeek-V3: 8 of
    32 experts, 1.9 GB each, not 15 GB). DeepSeek-V3 at 4096 tokens (128 rows per expert) decodes
    only the activations. Decode and mid-size batches keep the codes (docs/performance.md,
    scripts/nvfp4_study.py)."""
    from moeshard.kernels.configs import decode_window, decoded_weight_bytes

    mixtral = select_config(4096 * 2, 8, 4096, 14336, "nvfp4")
    bf16 = select_config(4096 * 2, 8, 4096, 14336, "none")
    assert (mixtral.decode_nvfp4, mixtral.decode_experts) == ("all", 0)
    assert (mixtral.gate_up, mixtral.down, mixtral.lay_out_a) == (bf16.gate_up, bf16.down, bf16.lay_out_a)
    qwen3 = select_config(4096 * 8, 128, 2048, 768, "nvfp4")
    assert (qwen3.decode_nvfp4, qwen3.decode_experts) == ("all", 0)
    assert qwen3.gate_up == select_config(4096 * 8, 128, 2048, 768, "none").gate_up
    deepseek = select_config(16384 * 8, 256, 7168, 2048, "nvfp4")
    assert (deepseek.decode_nvfp4, deepseek.decode_experts) == ("all", 32)
    assert decoded_weight_bytes(32, 7168, 2048) <= 2 * 2**30 < decoded_weight_bytes(37, 7168, 2048)
    assert decode_window(256, 7168, 2048) == 32 and decode_window(8, 4096, 14336) == 0
    assert decode_window(9, 8192, 16384) == 3  # 512 MiB per expert: 4 fit, so 3 windows, of 3 each (not 4, 4, 1)
    assert select_config(4096 * 8, 256, 7168, 2048, "nvfp4").decode_nvfp4 == "activations"
    for shape in ((2, 8, 4096, 14336), (128, 8, 4096, 14336), (8, 256, 7168, 2048)):
        assert select_config(*shape, "nvfp4").decode_nvfp4 == "off", shape
    for scheme in ("none", "fp8_tensor", "fp8_block"):
        assert select_config(4096 * 2, 8, 4096, 14336, scheme).decode_nvfp4 == "off", scheme
