"""One token's routed rows on the direct plan (``align.direct_rows``, ``ExpertsConfig.direct``):
a tile per row and no plan kernel, the same bits as the sorted plan of ``align_rows``.

A decode step of one token waits for the tile plan before its first GEMM; the direct plan takes
the routed rows' expert ids as the tiles' experts instead. These run the Triton kernels in the
CPU interpreter on both plans and compare every written row bit for bit, for every scheme and
each way h is quantized between the GEMMs, with one token's distinct experts, with a padding row
(id -1, written nowhere on either plan) and with an expert chosen twice (correct on the direct
plan too, its weights read once per row).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moeshard.experts.base import ExpertInput, ExpertWeights
from moeshard.quant import quantize_weight

SCHEMES = ["none", "fp8_tensor", "fp8_token", "fp8_block", "nvfp4"]
H, I, E, K = 64, 128, 6, 4  # noqa: E741
IDS = {"distinct": [5, 0, 3, 2], "padding": [2, -1, 0, 5], "repeated": [1, 1, 4, 0]}


def _weights(scheme: str, seed: int = 3) -> ExpertWeights:
    g = torch.Generator().manual_seed(seed)
    gu = (torch.randn(E, 2 * I, H, generator=g) / H**0.5).to(torch.bfloat16)
    dn = (torch.randn(E, H, I, generator=g) / I**0.5).to(torch.bfloat16)
    if scheme == "none":
        return ExpertWeights(gu, dn)
    return ExpertWeights(quantize_weight(gu, scheme), quantize_weight(dn, scheme), scheme)


def _configs(k, scheme: str) -> dict[str, object]:
    """The sorted-plan configs tried for ``scheme``: each way h is quantized between the GEMMs."""
    GemmConfig, ExpertsConfig = k.configs.GemmConfig, k.configs.ExpertsConfig
    base = ExpertsConfig(GemmConfig(16, 32, 32), GemmConfig(16, 32, 32))
    out = {"pass": base}
    if scheme == "fp8_token":
        out["row_max"] = dataclasses.replace(base, h_quant="row_max")
    if scheme == "fp8_block":
        out["gate_up"] = ExpertsConfig(GemmConfig(16, 128, 32), GemmConfig(16, 32, 32), h_quant="gate_up")
    return out


def _poisoned_empty(empty):
    """``torch.empty`` whose memory reads as NaN (floats) or 2^30 (integers): a buffer the direct
    path forgets to zero or write then shows in the output, whatever the allocator hands back."""
    def poisoned(*args, **kwargs):
        t = empty(*args, **kwargs)
        if t.dtype.is_floating_point:
            return t.fill_(float("nan")) if t.element_size() > 1 else t.view(torch.uint8).fill_(0x7F).view(t.dtype)
        return t.fill_(2**30) if t.dtype in (torch.int32, torch.int64) else t
    return poisoned


@pytest.mark.parametrize("ids", IDS)
@pytest.mark.parametrize("scheme", SCHEMES)
def test_one_token_on_the_direct_plan_is_the_sorted_plans_bits(interpreted_kernels, monkeypatch, scheme, ids):
    k = interpreted_kernels
    x = (torch.randn(1, H, generator=torch.Generator().manual_seed(7)) * 3).to(torch.bfloat16)
    expert_ids = torch.tensor(IDS[ids])
    inp = ExpertInput(x, expert_ids, repeat=K)
    w = _weights(scheme)
    written = expert_ids >= 0
    for name, config in _configs(k, scheme).items():
        want = k.experts.TritonExperts("silu", torch.bfloat16, config)(inp, w)
        with monkeypatch.context() as m:  # the direct plan runs no plan kernel
            m.setattr(k.experts, "align_rows", lambda *a, **kw: pytest.fail("align_rows ran on a one-token call"))
            m.setattr(torch, "empty", _poisoned_empty(torch.empty))
            got = k.experts.TritonExperts("silu", torch.bfloat16, dataclasses.replace(config, direct=True))(inp, w)
        assert torch.equal(got[written], want[written]), (scheme, ids, name)
        assert want[written].abs().sum() > 0
        if scheme in ("fp8_tensor", "fp8_token", "fp8_block"):
            # h quantized by the down GEMM as it loads each tile's one row: no quantize_h runs.
            # fp8_block's down then steps over whole 128-column scale groups (K = I = 128 here).
            if scheme == "fp8_block":
                config = dataclasses.replace(config, down=dataclasses.replace(config.down, block_k=128))
                want = k.experts.TritonExperts("silu", torch.bfloat16, config)(inp, w)
            in_down = dataclasses.replace(config, direct=True, quantize_in_down=True)
            with monkeypatch.context() as m:
                m.setattr(k.experts, "quantize_h", lambda *a, **kw: pytest.fail("quantize_h ran"))
                m.setattr(torch, "empty", _poisoned_empty(torch.empty))
                got = k.experts.TritonExperts("silu", torch.bfloat16, in_down)(inp, w)
            assert torch.equal(got[written], want[written]), (scheme, ids, name, "quantize_in_down")


def test_more_tokens_keep_the_sorted_plan(interpreted_kernels, monkeypatch):
    """``direct`` is taken for one token's rows only: two tokens' rows may share experts, whose
    weights a direct plan would read once per row."""
    k = interpreted_kernels
    config = dataclasses.replace(_configs(k, "fp8_tensor")["pass"], direct=True)
    x = torch.randn(2, H, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    inp = ExpertInput(x, torch.tensor([0, 1, 1, 2, 1, 3, 0, 4]), repeat=K)
    calls = []
    align_rows = k.experts.align_rows
    monkeypatch.setattr(k.experts, "align_rows", lambda *a, **kw: calls.append(1) or align_rows(*a, **kw))
    k.experts.TritonExperts("silu", torch.bfloat16, config)(inp, _weights("fp8_tensor"))
    assert calls == [1]


def test_direct_plan_refusals(interpreted_kernels):
    k = interpreted_kernels
    GemmConfig, ExpertsConfig = k.configs.GemmConfig, k.configs.ExpertsConfig
    with pytest.raises(ValueError, match="direct runs both Triton GEMMs on one direct plan; got block_m 32 / 16"):
        ExpertsConfig(GemmConfig(32, 32, 32), GemmConfig(16, 32, 32), direct=True)
    plan = k.align.direct_rows(torch.tensor([3, 1]), E, 32)
    assert (plan.direct, plan.max_tiles, plan.padded_rows, plan.start.shape[0]) == (True, 2, 64, E)
    with pytest.raises(ValueError, match="a direct plan .* has no shorter tiles"):
        k.align.split_tiles(plan, 16)
    with pytest.raises(ValueError, match="lay_out_rows: the plan is direct"):
        k.layout.lay_out_rows(torch.zeros(2, H, dtype=torch.bfloat16), plan, 1)
    with pytest.raises(ValueError, match=r"expert_ids must be int32 or int64 \[M\]"):
        k.align.direct_rows(torch.tensor([[3, 1]]), E, 32)


def test_decode_configs_take_the_direct_plan(interpreted_kernels):
    """``select_config`` allows the direct plan at decode (one token's rows then take it), not at
    prefill, where the Gluon GEMMs and the laid-out input need the sorted plan."""
    select = interpreted_kernels.configs.select_config
    for rows, E_, H_, I_ in ((8, 256, 7168, 2048), (2, 8, 4096, 14336), (8, 128, 2048, 768)):
        for scheme in SCHEMES:
            assert select(rows, E_, H_, I_, scheme).direct, (rows, E_, scheme)
            # ... and the per-row fp8 schemes' one token quantizes h in the down GEMM's loads, in
            # 256-column K steps (fp8_block keeps h_quant's way: configs.IN_DOWN_TILES)
            cfg = select(rows, E_, H_, I_, scheme)
            assert cfg.quantize_in_down == (scheme in ("fp8_tensor", "fp8_token")), (rows, scheme)
            assert not cfg.quantize_in_down or (cfg.down.block_m, cfg.down.block_k) == (16, 256), cfg
            # ... and on an H100 fp8_block's one token runs as matrix-vector products (kernels.gemv),
            # not on an H200, where they were not timed
            h100 = select(rows, E_, H_, I_, scheme, gpu="h100")
            assert (h100.gemv is not None) == (scheme == "fp8_block"), (rows, scheme, h100.gemv)
            assert cfg.gemv is None, (rows, scheme, cfg.gemv)
            assert h100 == dataclasses.replace(cfg, gemv=h100.gemv), (rows, scheme)
    # ... not for more rows than one token routes, nor where K is not whole scale groups
    assert select(16, 256, 7168, 2048, "fp8_block", gpu="h100").gemv is None
    assert select(2, 8, 4096, 14400, "fp8_block", gpu="h100").gemv is None
    # ... not where the down GEMM's K steps would be 128 columns (I not a multiple of 256), nor for
    # more rows than one token routes (the sorted plan)
    assert not select(8, 64, 512, 384, "fp8_tensor").quantize_in_down
    assert not select(16, 256, 7168, 2048, "fp8_tensor").quantize_in_down
    for scheme in SCHEMES:  # prefill, on either engine
        assert not select(8 * 4096, 256, 7168, 2048, scheme).direct, scheme
        assert not select(8 * 4096, 256, 7168, 2048, scheme, gluon=True).direct, scheme
    # A decode config given a laid-out input: the refusal says where direct came from.
    chosen = select(8, 256, 7168, 2048, "fp8_tensor")
    with pytest.raises(ValueError, match=r"select_config sets direct=True for decode sizes: "
                                         r"replace\(config, direct=False, quantize_in_down=False, ...\)"):
        dataclasses.replace(chosen, lay_out_a=True)
    assert dataclasses.replace(chosen, lay_out_a=True, direct=False, quantize_in_down=False).lay_out_a


def test_quantize_in_down_refusals(interpreted_kernels):
    """h quantized as the down GEMM loads it: only of a direct plan's fp8 down GEMM, with the
    scales each scheme needs; every other call is refused by name before any launch."""
    k = interpreted_kernels
    GemmConfig, ExpertsConfig = k.configs.GemmConfig, k.configs.ExpertsConfig
    with pytest.raises(ValueError, match="quantize_in_down .* needs direct=True and decode_nvfp4='off', got direct=False"):
        ExpertsConfig(GemmConfig(16, 32, 128), GemmConfig(16, 32, 128), quantize_in_down=True)
    # ... refused by the experts before any launch (the gate_up GEMM would run first)
    one = ExpertInput(torch.zeros(1, H, dtype=torch.bfloat16), torch.tensor([3, 1]), repeat=2)
    with pytest.raises(ValueError, match="down.block_k=64 is not 128 or 256"):
        k.experts.TritonExperts("silu", torch.bfloat16, ExpertsConfig(
            GemmConfig(16, 32, 64), GemmConfig(16, 32, 64), direct=True, quantize_in_down=True))(one, _weights("fp8_block"))
    for scheme in ("none", "nvfp4"):  # nothing to quantize in down, or not these kernels' way
        with pytest.raises(ValueError, match=f"quantize_in_down quantizes h of fp8_tensor, .* the experts are {scheme}"):
            k.experts.TritonExperts("silu", torch.bfloat16, ExpertsConfig(
                GemmConfig(16, 32, 128), GemmConfig(16, 32, 128), direct=True, quantize_in_down=True))(one, _weights(scheme))
    moe_gemm = k.grouped_gemm.moe_gemm
    ids = torch.tensor([3, 1])
    direct, sorted_plan = k.align.direct_rows(ids, E, 16), k.align.align_rows(ids, E, 16)
    tile = GemmConfig(16, 32, 128)
    out = torch.empty(2, H, dtype=torch.bfloat16)
    h = torch.zeros(direct.padded_rows, I, dtype=torch.bfloat16)
    down = {s: _weights(s).down for s in ("fp8_tensor", "fp8_token", "fp8_block", "none")}
    amax = torch.zeros(E)
    with pytest.raises(ValueError, match="direct plan; got down, gather=False, direct plan: False"):
        moe_gemm(torch.zeros(sorted_plan.padded_rows, I, dtype=torch.bfloat16), down["fp8_tensor"], sorted_plan, out,
                 tile, activation=None, gather=False, quantize_a=True, a_amax=amax)
    with pytest.raises(ValueError, match="weights 'none'"):
        moe_gemm(h, down["none"], direct, out, tile, activation=None, gather=False, quantize_a=True)
    with pytest.raises(ValueError, match=r"fp8_tensor needs a_amax, the contiguous float32 \[6\] per-expert amax"):
        moe_gemm(h, down["fp8_tensor"], direct, out, tile, activation=None, gather=False, quantize_a=True)
    with pytest.raises(ValueError, match=r"fp8_token needs a_amax, the contiguous float32 \[32\] row maxima"):
        moe_gemm(h, down["fp8_token"], direct, out, tile, activation=None, gather=False, quantize_a=True, a_amax=amax)
    with pytest.raises(ValueError, match="fp8_block scales each 128-column group by its own amax"):
        moe_gemm(h, down["fp8_block"], direct, out, tile, activation=None, gather=False, quantize_a=True, a_amax=amax)
    with pytest.raises(ValueError, match="config.block_k=64 must be 128 or 256"):
        moe_gemm(h, down["fp8_block"], direct, out, GemmConfig(16, 32, 64), activation=None, gather=False,
                 quantize_a=True)
    with pytest.raises(ValueError, match="a_amax .* needs quantize_a=True"):
        moe_gemm(h, down["fp8_tensor"], direct, out, tile, activation=None, gather=False, a_amax=amax)


def test_down_prefetch_refusals_and_the_bytes_each_row_asks_for(interpreted_kernels):
    """The down weights asked for before the down GEMM's wait: only of a down GEMM launched under
    PDL on the Triton engine (refused by name otherwise, before any launch); each row asks for
    its first columns, at most K, in the bulk prefetch's 16-byte unit, and nothing where the
    rows are not contiguous and aligned or go through TMA (hand-computed)."""
    k = interpreted_kernels
    GemmConfig, ExpertsConfig = k.configs.GemmConfig, k.configs.ExpertsConfig
    tile = GemmConfig(16, 32, 128)
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match=f"ExpertsConfig.down_prefetch: expected an int >= 0 .* got {bad!r}"):
            ExpertsConfig(tile, tile, pdl="all", down_prefetch=bad)
    for pdl in ("off", "gate_up"):
        with pytest.raises(ValueError, match=f"down_prefetch=512 .* needs pdl='all' .* got pdl='{pdl}'"):
            ExpertsConfig(tile, tile, pdl=pdl, down_prefetch=512)
    assert ExpertsConfig(tile, tile, pdl="all", down_prefetch=512).down_prefetch == 512
    moe_gemm = k.grouped_gemm.moe_gemm
    ids = torch.tensor([3, 1])
    plan = k.align.direct_rows(ids, E, 16)
    h = torch.zeros(plan.padded_rows, I, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="prefetch_w=512 .* needs pdl_launch=True and the Triton engine, "
                                         "got pdl_launch=False"):
        moe_gemm(h, _weights("none").down, plan, torch.empty(2, H, dtype=torch.bfloat16), tile, activation=None,
                 gather=False, prefetch_w=512)
    with pytest.raises(ValueError, match="prefetch_w must be an int >= 0"):
        moe_gemm(h, _weights("none").down, plan, torch.empty(2, H, dtype=torch.bfloat16), tile, activation=None,
                 gather=False, prefetch_w=-8)
    nbytes = k.grouped_gemm._prefetch_bytes
    fp8 = torch.zeros(2, 64, 2048, dtype=torch.float8_e4m3fn)
    bf16 = torch.zeros(2, 64, 2048, dtype=torch.bfloat16)
    assert nbytes(fp8, 512, False) == 512 and nbytes(fp8, 16384, False) == 2048  # at most the row
    assert nbytes(bf16, 512, False) == 1024 and nbytes(fp8, 100, False) == 96  # 16-byte unit
    assert nbytes(fp8, 0, False) == 0 and nbytes(fp8, 512, True) == 0  # none asked; TMA weights
    assert nbytes(fp8.transpose(1, 2), 512, False) == 0  # rows not contiguous
    assert nbytes(torch.zeros(2, 64, 2056, dtype=torch.float8_e4m3fn)[:, :, 8:], 512, False) == 0  # unaligned


def test_fp8_block_row_over_two_scale_groups_gives_the_pass_bits(interpreted_kernels, monkeypatch):
    """fp8_block's one row over a 256-column down step, its two 128-column scale groups loaded at
    once and quantized each by its own amax (``grouped_gemm._direct_row_fp8_groups``): the bits of
    quantize_h's pass on the sorted plan."""
    k = interpreted_kernels
    GemmConfig, ExpertsConfig = k.configs.GemmConfig, k.configs.ExpertsConfig
    g = torch.Generator().manual_seed(11)
    inter = 256
    gu = (torch.randn(E, 2 * inter, H, generator=g) / H**0.5).to(torch.bfloat16)
    dn = (torch.randn(E, H, inter, generator=g) / inter**0.5).to(torch.bfloat16)
    dn[:, :, 128:] *= 40  # the two groups' scales differ
    w = ExpertWeights(quantize_weight(gu, "fp8_block"), quantize_weight(dn, "fp8_block"), "fp8_block")
    x = (torch.randn(1, H, generator=g) * 3).to(torch.bfloat16)
    expert_ids = torch.tensor(IDS["padding"])
    inp = ExpertInput(x, expert_ids, repeat=K)
    config = ExpertsConfig(GemmConfig(16, 32, 32), GemmConfig(16, 32, 256))
    want = k.experts.TritonExperts("silu", torch.bfloat16, config)(inp, w)
    with monkeypatch.context() as m:
        m.setattr(k.experts, "quantize_h", lambda *a, **kw: pytest.fail("quantize_h ran"))
        got = k.experts.TritonExperts("silu", torch.bfloat16,
                                      dataclasses.replace(config, direct=True, quantize_in_down=True))(inp, w)
    written = expert_ids >= 0
    assert torch.equal(got[written], want[written])
    assert want[written].abs().sum() > 0
