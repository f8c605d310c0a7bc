"""The experts' input laid out at the tile plan's padded positions (``kernels.layout``), and the
gate_up GEMM reading it as blocks (``ExpertsConfig.lay_out_a``): Triton's CPU interpreter runs the
kernels; tests/gpu checks the compiled ones.

The layout is a copy, so everything here is compared bit for bit: against a torch statement of
where each row goes, and against the gathered path it replaces."""

from __future__ import annotations

import pytest
import torch

from moeshard.experts.base import ExpertInput, ExpertWeights
from moeshard.kernels.configs import select_config
from moeshard.quant import QuantizedActivations, get_scheme, quantize_activations, quantize_weight

SCHEMES = ["none", "fp8_tensor", "fp8_token", "fp8_block", "nvfp4"]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


def _fields(x) -> list[torch.Tensor | None]:
    if isinstance(x, QuantizedActivations):
        return [x.data, x.row_scale, x.tensor_scale]
    return [x]


def _expected(t: torch.Tensor, plan, repeat: int) -> torch.Tensor:
    """Where each row goes, stated in torch: position p of expert e's positions [start, start +
    count) holds row sorted_rows[p] // repeat; every other position (the rest of an expert's last
    tile, tiles past the last) holds zeros."""
    out = torch.zeros(plan.padded_rows, t.shape[1], dtype=t.dtype)
    for start, count in zip(plan.start.tolist(), plan.count.tolist(), strict=True):
        for p in range(start, start + count):
            _bits(out)[p] = _bits(t)[int(plan.sorted_rows[p]) // repeat]
    return out


def _input(scheme: str, tokens: int, hidden: int, seed: int, per_row_scale: bool = False):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16)
    if scheme == "none":
        return x
    if per_row_scale:  # fp8_tensor with one scale per row (an amax given per row)
        return quantize_activations(x, scheme, amax=x.float().abs().amax(dim=1, keepdim=True))
    return quantize_activations(x, scheme)


@pytest.mark.parametrize("scheme", SCHEMES + ["fp8_tensor-per-row"])
@pytest.mark.parametrize("repeat", [1, 3])
def test_each_routed_row_lands_at_its_position_and_padding_is_zero(interpreted_kernels, scheme, repeat):
    """Experts of 40 rows (two 32-row tiles), 1, 31 and 0 rows, over tokens repeated ``repeat``
    times; the data, its row scales and a per-row tensor scale all move with their row, and a
    single tensor scale stays the same tensor."""
    k = interpreted_kernels
    per_row = scheme.endswith("-per-row")
    scheme = scheme.removesuffix("-per-row")
    hidden = 2304  # more than one program's columns for every element size (1024 bytes each)
    counts = [40, 1, 31, 0]
    ids = torch.cat([torch.full((c,), e) for e, c in enumerate(counts)])
    ids = ids[torch.randperm(ids.numel(), generator=torch.Generator().manual_seed(repeat))]
    tokens = -(-ids.numel() // repeat)
    ids = torch.cat([ids, torch.full((tokens * repeat - ids.numel(),), 2)])  # M = tokens * repeat
    x = _input(scheme, tokens, hidden, seed=5, per_row_scale=per_row)
    plan = k.align.align_rows(ids, len(counts), 32)
    out = k.layout.lay_out_rows(x, plan, repeat)
    for got, src in zip(_fields(out), _fields(x), strict=True):
        if src is None:
            assert got is None
        elif src.dim() == 0:
            assert got is src
        else:
            assert got.dtype == src.dtype and got.shape == (plan.padded_rows, src.shape[1])
            assert torch.equal(_bits(got), _bits(_expected(src, plan, repeat)))


def test_rows_that_do_not_match_the_plan_are_refused(interpreted_kernels):
    k = interpreted_kernels
    plan = k.align.align_rows(torch.tensor([0, 1, 1, 0, 2, 2]), 3, 16)
    with pytest.raises(ValueError, match="x has 4 rows and repeat=2, the plan has 6 routed rows"):
        k.layout.lay_out_rows(torch.zeros(4, 64, dtype=torch.bfloat16), plan, 2)


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "tma"])
def test_gate_up_on_the_laid_out_input_gives_the_gathered_bits(interpreted_kernels, exact_interpreter, scheme, tma):
    """h at every padded position (padding zeros included), the per-expert amax and the experts'
    output y must equal the gathered path's bit for bit, with tokens repeated for their routed
    rows as the local backend passes them, and with half tiles."""
    k = interpreted_kernels
    GemmConfig, ExpertsConfig = k.configs.GemmConfig, k.configs.ExpertsConfig
    E, H, I, repeat = 4, 128, 96, 2
    counts = [40, 30, 3, 17]  # two tiles (the second a half tile), one, one half tile, one half tile
    ids = torch.cat([torch.full((c,), e) for e, c in enumerate(counts)])
    ids = ids[torch.randperm(ids.numel(), generator=torch.Generator().manual_seed(2))]
    x = _input(scheme, ids.numel() // repeat, H, seed=7)
    gen = torch.Generator().manual_seed(3)
    gu = (torch.randn(E, 2 * I, H, generator=gen) / H**0.5).to(torch.bfloat16)
    dn = (torch.randn(E, H, I, generator=gen) / I**0.5).to(torch.bfloat16)
    w = ExpertWeights(gu, dn) if scheme == "none" else \
        ExpertWeights(quantize_weight(gu, scheme), quantize_weight(dn, scheme), scheme)
    gemm = GemmConfig(32, 64, 32, group_m=2, tma=tma, half_tiles=True)
    plan = k.align.align_rows(ids, E, 32)
    per_tensor = get_scheme(scheme).per_tensor_activation
    hs = {}
    for lay_out in (False, True):
        amax = torch.zeros(E) if per_tensor else None
        h = torch.full((plan.padded_rows, I), float("nan"), dtype=torch.bfloat16)
        a = k.layout.lay_out_rows(x, plan, repeat) if lay_out else x
        k.grouped_gemm.moe_gemm(a, w.gate_up, plan, h, gemm, activation="silu", gather=not lay_out, amax=amax,
                                a_row_div=1 if lay_out else repeat)
        hs[lay_out] = (h, amax)
    (h0, a0), (h1, a1) = hs[False], hs[True]
    live = plan.tile_expert.repeat_interleave(32) >= 0  # tiles past the last are never written
    assert not h1[live].isnan().any() and torch.equal(h0[live], h1[live])
    assert a0 is None or torch.equal(a0, a1)
    ys = [k.experts.TritonExperts("silu", torch.bfloat16, ExpertsConfig(gemm, gemm, lay_out_a=lay_out))(
          ExpertInput(x, ids, repeat=repeat), w) for lay_out in (False, True)]
    assert torch.equal(ys[0], ys[1])


def test_the_input_is_laid_out_where_it_was_measured_to_pay():
    """bf16 and fp8_block at Mixtral's prefill (1024 and 4096 rows per expert); not fp8_tensor,
    which measured no faster, nor below 1024 rows per expert, nor for Qwen3's narrow experts, nor
    at decode (docs/performance.md, scripts/gather_study.py)."""
    mixtral_4096, mixtral_16384 = (4096 * 2, 8, 4096, 14336), (16384 * 2, 8, 4096, 14336)
    for shape in (mixtral_4096, mixtral_16384):
        for scheme, expected in (("none", True), ("fp8_block", True), ("fp8_tensor", False), ("fp8_token", False)):
            cfg = select_config(*shape, scheme)
            assert cfg.lay_out_a is expected, (shape, scheme)
            assert not cfg.lay_out_a or cfg.gate_up.tma, (shape, scheme)  # laid out so that TMA loads it
    # DeepSeek-V3 and Qwen3 at 4096 tokens (128 and 256 rows per expert), Qwen3 at 16384 (1024 rows
    # per expert, but a gate_up of 1536 columns, whose savings the layout's pass outweighs), decode.
    for shape in ((4096 * 8, 256, 7168, 2048), (4096 * 8, 128, 2048, 768), (16384 * 8, 128, 2048, 768),
                  (16, 8, 4096, 14336)):
        for scheme in ("none", "fp8_block"):
            assert not select_config(*shape, scheme).lay_out_a, (shape, scheme)


def test_ep_on_one_rank_is_refused_not_contradicted():
    """dp1-tp1-ep was listed as a valid layout, then every EP backend refused it as EP off and the
    local backend as EP on: one rank holds every expert, so EP there is refused once, up front."""
    from moeshard.parallel.config import ParallelConfig

    for build in (lambda: ParallelConfig(1, 1, True), lambda: ParallelConfig.parse("dp1-tp1-ep")):
        with pytest.raises(ValueError, match=r"ParallelConfig.enable_ep: expert parallelism spreads the experts "
                                             r"over ranks, but dp=1, tp=1 is one rank"):
            build()
    assert ParallelConfig(2, 1, True).ep_size == 2 and ParallelConfig(1, 2, True).is_sequence_parallel
