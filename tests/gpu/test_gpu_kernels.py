"""GPU checks of the Triton expert kernels, the local backend and the graph-safe forward.

Run on a CUDA machine: ``PYTHONPATH=src python3 -m pytest tests/gpu -q``; skipped without CUDA.

* ``TritonExperts`` against an fp64 expert loop with the reference's numerics (gate_up rounded
  to the model dtype, act(gate) * up rounded, h quantized with per-expert per-tensor scales),
  every scheme, decode / mid / prefill shapes, within the one tolerance table;
* ``quantize_h`` and the fused input quantization bit for bit against ``quantize_activations``;
* ``MoELayer`` (one GPU, local backend) against ``reference_forward``;
* no host synchronisation in the forward (``torch.cuda.set_sync_debug_mode("error")``);
* CUDA-graph capture of the forward, replayed on new inputs, against eager.
"""

from __future__ import annotations

import pytest
import torch
from quant_asserts import assert_same_quantization, quantized_positions

CUDA = torch.cuda.is_available()
pytestmark = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")

if CUDA:
    from moeshard.bench.tune import SWEEPS
    from moeshard.config import QuantConfig
    from moeshard.dispatch.combine_kernel import combine_topk
    from moeshard.experts.base import ExpertInput, ExpertWeights
    from moeshard.kernel_choice import select_kernel
    from moeshard.kernels.align import align_rows
    from moeshard.kernels.configs import ExpertsConfig, GemmConfig, select_config
    from moeshard.kernels.experts import TritonExperts
    from moeshard.kernels.quant import quantize_h
    from moeshard.layer import MoELayer
    from moeshard.presets import PRESETS
    from moeshard.quant import (
        get_scheme,
        quantize_activations,
        quantize_weight,
    )
    from moeshard.reference import Reference, expert_reference, reference_forward
    from moeshard.tolerances import compare
    from moeshard.weights import MoEWeights

@pytest.fixture(autouse=True)
def _seeded():
    """Every test draws the same inputs whatever the order (pytest-xdist) it runs in."""
    torch.manual_seed(1234)


SCHEMES = ["none", "fp8_tensor", "fp8_token", "fp8_block", "nvfp4"]
# (rows M, experts E, hidden H, intermediate I): decode (BLOCK_M 16), small batches (streaming
# tiles of 32 and 64 rows), mid (64), prefill (128), an intermediate size that is not a
# multiple of any tile, and prefill at sizes that are not multiples of 128 (as gpt-oss's 2880:
# fp8_block's tiles carry a vector of weight scales, and K ends in half a block).
SHAPES = {"decode": (24, 64, 512, 256), "batch32": (128, 8, 512, 512), "batch64": (256, 8, 512, 512),
          "mid": (1600, 16, 512, 384), "prefill": (6144, 8, 1024, 1536), "odd": (999, 12, 256, 336),
          "prefill_odd": (6144, 8, 960, 1472)}


def _weights(E: int, H: int, I: int, dtype: torch.dtype, scheme: str, seed: int) -> ExpertWeights:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    gu = (torch.randn(E, 2 * I, H, device="cuda", generator=gen) / H**0.5).to(dtype)
    dn = (torch.randn(E, H, I, device="cuda", generator=gen) / I**0.5).to(dtype)
    if scheme == "none":
        return ExpertWeights(gu, dn)
    return ExpertWeights(quantize_weight(gu, scheme), quantize_weight(dn, scheme), scheme)


def _ids(M: int, E: int, seed: int) -> torch.Tensor:
    """Skewed routing: a third of the rows go to expert 1, some experts get none."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    ids = torch.randint(0, E, (M,), device="cuda", generator=gen)
    ids[: M // 3] = 1 % E
    return ids


def _check(out: torch.Tensor, ref: Reference, dtype, scheme: str, what: str) -> None:
    err, atol, rtol, ok = compare(out, ref, dtype, scheme)
    assert ok, (f"{what}: max |err| {err:.3g} exceeds atol {atol} + rtol {rtol} * |ref| + slack "
                f"(|ref| max {ref.out.abs().max():.3g}, slack max {ref.slack.max():.3g})")


CASES = [(torch.bfloat16, s, shape, "mma") for s in SCHEMES for shape in SHAPES] + \
        [(torch.float16, s, shape, "mma") for s in ("none", "fp8_token", "nvfp4") for shape in ("decode", "prefill")] + \
        [(torch.bfloat16, s, shape, "exact") for s in ("fp8_tensor", "fp8_token", "fp8_block") for shape in ("mid", "prefill")]


@pytest.mark.parametrize("dtype,scheme,shape,fp8_gate_up", CASES, ids=lambda v: str(v).replace("torch.", ""))
def test_triton_experts_match_reference(dtype, scheme, shape, fp8_gate_up):
    M, E, H, I = SHAPES[shape]
    w = _weights(E, H, I, dtype, scheme, seed=M)
    x = torch.randn(M, H, device="cuda", generator=torch.Generator(device="cuda").manual_seed(M + 2)).to(dtype)
    ids = _ids(M, E, seed=M + 1)
    xin = quantize_activations(x, scheme) if scheme != "none" else x
    kernel = TritonExperts("silu", dtype, fp8_gate_up=fp8_gate_up)
    y = kernel(ExpertInput(xin, ids), w)
    assert y.shape == (M, H) and y.dtype == dtype
    ref = expert_reference(xin, ids, w, "silu", dtype, accumulation=kernel.accumulation(scheme))
    _check(y, ref, dtype, scheme, f"{scheme} {shape} {fp8_gate_up}")


@pytest.mark.parametrize("activation", ["swiglu_clamped", "silu_clamped", "swiglu_softcapped"])
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("shape", ["decode", "batch64", "prefill", "prefill_odd"])
def test_biased_clamped_experts_match_reference(activation, scheme, shape):
    """gpt-oss's experts (biases, ``swiglu_clamped``), HY-V4's (``silu_clamped``) and Inkling
    2's (``swiglu_softcapped``), the last two here with biases too, on the Triton kernels: the
    gate_up weights scaled so that about a third of the products pass the limit (the up cap),
    biases of the products' size. At prefill the fp8 schemes take the Triton GEMMs where unbiased
    ``silu`` experts would take the Gluon ones."""
    from moeshard.activations import get_activation

    M, E, H, I = SHAPES[shape]
    params = get_activation(activation).params
    limit = params.get("limit", params.get("up_cap"))
    gen = torch.Generator(device="cuda").manual_seed(M + 5)
    gu = (torch.randn(E, 2 * I, H, device="cuda", generator=gen) * (limit / H**0.5)).to(torch.bfloat16)
    dn = (torch.randn(E, H, I, device="cuda", generator=gen) / I**0.5).to(torch.bfloat16)
    b13 = (torch.randn(E, 2 * I, device="cuda", generator=gen) * limit / 2).to(torch.bfloat16)
    b2 = torch.randn(E, H, device="cuda", generator=gen).to(torch.bfloat16)
    w = ExpertWeights(gu, dn, "none", b13, b2) if scheme == "none" else \
        ExpertWeights(quantize_weight(gu, scheme), quantize_weight(dn, scheme), scheme, b13, b2)
    x = torch.randn(M, H, device="cuda", generator=gen).to(torch.bfloat16)
    ids = _ids(M, E, seed=M + 1)
    xin = quantize_activations(x, scheme) if scheme != "none" else x
    kernel = select_kernel(activation, torch.bfloat16, torch.device("cuda"), scheme)
    assert type(kernel).__name__ == "TritonExperts"
    y = kernel(ExpertInput(xin, ids), w)
    ref = expert_reference(xin, ids, w, activation, torch.bfloat16, accumulation=kernel.accumulation(scheme))
    _check(y, ref, torch.bfloat16, scheme, f"{activation} {scheme} {shape}")


@pytest.mark.parametrize("preset", ["gpt-oss-120b", "hy-v4"])
@pytest.mark.parametrize("scheme", ["none", "fp8_token"])
def test_biased_and_clamped_layers_match_reference(preset, scheme):
    """gpt-oss's and HY-V4's layers on the Triton experts, against the reference, at the inputs
    of ``test_layer_matches_reference`` and at four times them, where large expert outputs
    cancel to small sums and only the reference's pricing of the output roundings keeps a
    correct layer within the bound (tests/test_reference.py shows it on CPU up to eight times)."""
    cfg, weights, layer = _layer(preset, scheme)
    assert type(layer.kernel).__name__ == "TritonExperts"
    for T in (1, 300):
        for scale in (1.0, 4.0):
            x = (torch.randn(T, cfg.hidden_size, generator=torch.Generator().manual_seed(T)) * scale).to(cfg.dtype)
            ref = reference_forward(x, weights, cfg, QuantConfig(scheme), accumulation=layer.accumulation)
            _check(layer(x.cuda()).cpu(), ref, cfg.dtype, scheme, f"layer {preset} {scheme} T={T} x{scale:g}")


@pytest.mark.parametrize("scheme", ["fp8_tensor", "fp8_token", "fp8_block"])
@pytest.mark.parametrize("gpu", ["h200", "h100"])
def test_each_gpus_decode_tiles_match_reference(scheme, gpu):
    """The decode tiles ``select_config`` takes for either GPU kind (``configs.GPU_KINDS``), run
    on this GPU whatever it is: at 64-row tiles the H100's take 256-column K steps and the H200's
    128-column ones, so both tables' tiles are computed wherever the suite runs."""
    M, E, H, I = SHAPES["batch64"]  # noqa: E741
    cfg = select_config(M, E, H, I, scheme, gpu=gpu)
    assert cfg.block_m == 64 and cfg.gate_up.block_k == (256 if gpu == "h100" else 128), cfg
    w = _weights(E, H, I, torch.bfloat16, scheme, seed=M)
    x = torch.randn(M, H, device="cuda").to(torch.bfloat16)
    xin = quantize_activations(x, scheme)
    ids = _ids(M, E, seed=M + 1)
    kernel = TritonExperts("silu", torch.bfloat16, cfg)
    y = kernel(ExpertInput(xin, ids), w)
    ref = expert_reference(xin, ids, w, "silu", torch.bfloat16, accumulation=kernel.accumulation(scheme))
    _check(y, ref, torch.bfloat16, scheme, f"{scheme} batch64 {gpu}")


@pytest.mark.parametrize("scheme", ["none", "fp8_tensor", "fp8_token", "fp8_block", "nvfp4"])
def test_one_token_direct_plan_gives_the_sorted_plans_bits(scheme):
    """One token's routed rows (``repeat`` equal to the rows) on the decode config
    ``select_config`` picks, which takes the direct plan (``ExpertsConfig.direct``: a tile per row,
    no plan kernel, the ids int64), against the same config on the sorted plan: the same bits,
    for DeepSeek-V3's and Mixtral's one-token shapes (8 of 256 experts, 2 of 8), eager and in a
    replayed CUDA graph, and a padding row (-1) left out on both. The fp8 schemes' direct config
    quantizes h in the down GEMM's loads (``quantize_in_down``), the sorted plan in quantize_h."""
    import dataclasses

    for E, H, I, ids in ((256, 1024, 512, [200, 3, 17, 255, 0, 128, 64, 9]), (8, 512, 1792, [5, 2]),
                         (64, 512, 384, [7, -1, 63, 12])):
        K = len(ids)
        w = _weights(E, H, I, torch.bfloat16, scheme, seed=E)
        x = torch.randn(1, H, device="cuda").to(torch.bfloat16)
        expert_ids = torch.tensor(ids, device="cuda")
        inp = ExpertInput(x, expert_ids, repeat=K)
        direct = select_config(K, E, H, I, scheme, pdl=True)
        assert direct.direct, direct
        # fp8_block's one token runs as matrix-vector products (other sums: test_one_token_gemv_*);
        # here its tile GEMMs on the direct plan.
        direct = dataclasses.replace(direct, gemv=None)
        sorted_plan = TritonExperts("silu", torch.bfloat16,
                                    dataclasses.replace(direct, direct=False, quantize_in_down=False))
        kernel = TritonExperts("silu", torch.bfloat16, direct)
        want, got = sorted_plan(inp, w), kernel(inp, w)
        live = expert_ids >= 0
        assert torch.equal(got[live], want[live]), (scheme, E)
        assert want[live].abs().sum() > 0
        graph, static = _captured(lambda _, kernel=kernel, inp=inp, w=w: kernel(inp, w), x)
        x.copy_(torch.randn(1, H, device="cuda").to(torch.bfloat16))
        graph.replay()
        assert torch.equal(static[live], sorted_plan(inp, w)[live]), (scheme, E, "graph")


@pytest.mark.parametrize("gemv", [(16, 16, 256, 4), (32, 8, 512, 8), (8, 32, 128, 2)], ids=str)
@pytest.mark.parametrize("scheme", ["fp8_tensor", "fp8_token", "fp8_block"])
def test_one_token_gemv_matches_reference(scheme, gemv):
    """One token's rows as matrix-vector products (``ExpertsConfig.gemv``) against the reference,
    at DeepSeek-V3's and Mixtral's one-token shapes (8 of 256 experts, 2 of 8) and one with a
    padding row and an intermediate size no step divides; launched serially and under each PDL
    chain, the same bits, eagerly and in a replayed CUDA graph with a new input."""
    for E, H, I, ids in ((256, 1024, 512, [200, 3, 17, 255, 0, 128, 64, 9]), (8, 512, 1792, [5, 2]),
                         (64, 512, 384, [7, -1, 63, 12])):
        _one_token_gemv_case(scheme, gemv, E, H, I, ids)


def _one_token_gemv_case(scheme: str, gemv: tuple[int, int, int, int], E: int, H: int, I: int,  # noqa: E741
                         ids: list[int]) -> None:
    import dataclasses

    from moeshard.kernels.configs import GemvConfig
    from moeshard.kernels.pdl import supported

    K = len(ids)
    w = _weights(E, H, I, torch.bfloat16, scheme, seed=E)
    x = torch.randn(1, H, device="cuda").to(torch.bfloat16)
    expert_ids = torch.tensor(ids, device="cuda")
    live = expert_ids >= 0
    tiles = dataclasses.replace(select_config(K, E, H, I, scheme), pdl="off", quantize_in_down=False)
    serial = TritonExperts("silu", torch.bfloat16, dataclasses.replace(tiles, gemv=GemvConfig(*gemv)))

    def ref():
        xq = quantize_activations(x.expand(int(live.sum()), H).contiguous(), scheme)
        return expert_reference(xq, expert_ids[live], w, "silu", torch.bfloat16)

    def inp():
        return ExpertInput(quantize_activations(x, scheme), expert_ids, repeat=K)

    want = serial(inp(), w)
    _check(want[live], ref(), torch.bfloat16, scheme, f"gemv {gemv} E={E}")
    for chain in ("gate_up", "all") if supported(torch.device("cuda")) else ():
        kernel = TritonExperts("silu", torch.bfloat16, dataclasses.replace(tiles, gemv=GemvConfig(*gemv), pdl=chain))
        assert torch.equal(kernel(inp(), w)[live], want[live]), (scheme, E, chain)
        graph, static = _captured(lambda _, kernel=kernel: kernel(inp(), w), x)
        x.copy_(torch.randn(1, H, device="cuda").to(torch.bfloat16))
        graph.replay()
        assert torch.equal(static[live], serial(inp(), w)[live]), (scheme, E, chain, "graph")
        _check(static[live], ref(), torch.bfloat16, scheme, f"gemv {gemv} E={E} {chain} graph")
        want = serial(inp(), w)


@pytest.mark.parametrize("scheme", ["none", "fp8_tensor", "fp8_token", "fp8_block"])
def test_half_tiles_give_the_whole_tiles_bits(scheme):
    """The prefill tiles ``select_config`` picks, compiled, with and without half tiles: 64 experts
    of 60-200 rows (last tiles on both sides of 64 rows), h at every padded position and y the
    same bits (the 64-row wgmma sums each output in the order of the 128-row one)."""
    import dataclasses

    from moeshard.kernels.align import split_tiles
    from moeshard.kernels.grouped_gemm import moe_gemm

    E, H, I = 64, 512, 384
    counts = torch.randint(60, 200, (E,), generator=torch.Generator().manual_seed(3))
    ids = torch.repeat_interleave(torch.arange(E), counts)[torch.randperm(int(counts.sum()))].cuda()
    M = ids.shape[0]
    w = _weights(E, H, I, torch.bfloat16, scheme, seed=5)
    x = torch.randn(M, H, device="cuda").to(torch.bfloat16)
    xin = quantize_activations(x, scheme) if scheme != "none" else x
    sel = select_config(M, E, H, I, scheme)
    assert sel.gate_up.block_m == 128 and sel.gate_up.half_tiles, sel
    spec = get_scheme(scheme)
    outs = []
    for half in (False, True):
        gate_up = dataclasses.replace(sel.gate_up, half_tiles=half)
        down = dataclasses.replace(sel.down, half_tiles=half and sel.down.block_m == 128)
        amax = torch.empty(E, device="cuda") if spec.per_tensor_activation else None
        plan = align_rows(ids, E, 128, amax=amax)
        h = torch.full((plan.padded_rows, I), float("nan"), dtype=torch.bfloat16, device="cuda")
        moe_gemm(xin, w.gate_up, plan, h, gate_up, activation="silu", gather=True, amax=amax)
        h_in = quantize_h(h, scheme, plan, amax) if scheme != "none" else h
        y = torch.empty(M, H, dtype=torch.bfloat16, device="cuda")
        moe_gemm(h_in, w.down, split_tiles(plan, down.block_m), y, down, activation=None, gather=False)
        # Rows land in an expert's positions in the order of the plan's atomics, which varies
        # between plans: h is compared by routed row, and its padding positions must be zeros.
        tile_e = plan.tile_expert.long().repeat_interleave(128)
        pos = torch.arange(plan.padded_rows, device="cuda")
        used = tile_e >= 0
        real = used & (pos - plan.start.long()[tile_e.clamp(min=0)] < plan.count.long()[tile_e.clamp(min=0)])
        by_row = torch.empty(M, I, dtype=torch.bfloat16, device="cuda")
        by_row[plan.sorted_rows.long()[real]] = h[real]
        assert torch.equal(h[used & ~real], torch.zeros_like(h[used & ~real])), f"{scheme} half={half}: padding"
        outs.append((by_row, y))
    (h0, y0), (h1, y1) = outs
    assert torch.equal(h0, h1), f"{scheme}: h differs, max {(h0.float() - h1.float()).abs().max():.3g}"
    assert torch.equal(y0, y1), f"{scheme}: y differs, max {(y0.float() - y1.float()).abs().max():.3g}"


@pytest.mark.parametrize("scheme", ["fp8_tensor", "fp8_token"])
@pytest.mark.parametrize("H, I", [(512, 768), (640, 768), (256, 320), (256, 128)],
                         ids=["H512", "H640", "H256-I320", "H256-I128"])
def test_gluon_down_gives_the_triton_bits(scheme, H, I):
    """The Gluon persistent down GEMM (``GemmConfig.engine="gluon"``) against the Triton grouped
    GEMM on the same prefill tile: y bit for bit, with one program per SM and with three
    programs (each walking hundreds of tiles, its loads running into the next tile's), for
    experts of 0-300 rows (an empty expert, last tiles of every height), H a multiple of the
    256-column tile and not (640: the last column tile is partial), K of fewer steps than the
    ring has stages (320 and 128: three 128-column steps, the last partial, and one), and under
    CUDA-graph replay with new h. Shapes smaller than one tile are refused by name."""
    import dataclasses

    from moeshard.kernels.grouped_gemm import moe_gemm
    from moeshard.kernels.persistent_down import persistent_down

    E = 24
    counts = torch.randint(0, 300, (E,), generator=torch.Generator().manual_seed(7))
    counts[3] = 0
    ids = torch.repeat_interleave(torch.arange(E), counts)[torch.randperm(int(counts.sum()))].cuda()
    M = ids.shape[0]
    w = _weights(E, H, I, torch.bfloat16, scheme, seed=9)
    spec = get_scheme(scheme)
    amax = torch.empty(E, device="cuda") if spec.per_tensor_activation else None
    plan = align_rows(ids, E, 128, amax=amax)
    h = torch.randn(plan.padded_rows, I, device="cuda").to(torch.bfloat16)
    if amax is not None:
        amax.copy_(h.float().abs().amax().expand(E) * torch.linspace(0.5, 1.0, E, device="cuda"))
    hq = quantize_h(h, scheme, plan, amax)
    triton_cfg = GemmConfig(128, 256, 128, 8, 8, 3, tma=True, fp8_acc="imprecise")
    gluon_cfg = dataclasses.replace(triton_cfg, engine="gluon", num_stages=4)
    want = torch.full((M, H), float("nan"), dtype=torch.bfloat16, device="cuda")
    moe_gemm(hq, w.down, plan, want, triton_cfg, activation=None, gather=False)
    assert not want.isnan().any()
    for programs in (None, 3):
        got = torch.full((M, H), float("nan"), dtype=torch.bfloat16, device="cuda")
        persistent_down(hq, w.down, plan, got, gluon_cfg, programs=programs)
        assert torch.equal(got, want), f"{scheme} H={H} programs={programs}: max {(got.float() - want.float()).abs().max():.3g}"
    narrow = _weights(E, H, 64, torch.bfloat16, scheme, seed=3).down
    with pytest.raises(ValueError, match=f"H={H} and I=64 must be at least the tile's 256 columns"):
        persistent_down(quantize_h(h[:, :64].contiguous(), scheme, plan, amax), narrow, plan, got, gluon_cfg)
    y = torch.empty(M, H, dtype=torch.bfloat16, device="cuda")
    moe_gemm(hq, w.down, plan, y, gluon_cfg, activation=None, gather=False)  # compiles before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        moe_gemm(hq, w.down, plan, y, gluon_cfg, activation=None, gather=False)
    new = quantize_h(torch.randn_like(h), scheme, plan, amax)
    hq.data.copy_(new.data)
    (hq.row_scale if hq.row_scale is not None else hq.tensor_scale).copy_(
        new.row_scale if new.row_scale is not None else new.tensor_scale)
    graph.replay()
    moe_gemm(hq, w.down, plan, want, triton_cfg, activation=None, gather=False)
    assert torch.equal(y, want), f"{scheme} H={H}: graph replay with new h differs"


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh"])
def test_gluon_gate_up_gelu_epilogues_match_triton(activation):
    """The Gluon gate_up's erf and tanh GELU epilogues (ACT 1 and 2) against the Triton grouped
    GEMM's on the same prefill tile and the reference: the same h within one bf16 rounding (their
    exp and erf may differ in the last fp32 bit), every routed row written."""
    import dataclasses

    from moeshard.kernels.grouped_gemm import moe_gemm
    from moeshard.kernels.persistent_gate_up import persistent_gate_up

    E, H, I = 8, 1024, 768
    ids = _ids(1500, E, seed=9)
    w = _weights(E, H, I, torch.bfloat16, "fp8_token", seed=12)
    x = quantize_activations(torch.randn(1500, H, device="cuda").to(torch.bfloat16) * 3, "fp8_token")
    plan = align_rows(ids, E, 128)
    triton_cfg = GemmConfig(128, 128, 128, 8, 8, 4, tma=True, fp8_acc="imprecise")
    got, want = (torch.zeros(plan.padded_rows, I, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    rows_got, rows_want = (torch.zeros(plan.padded_rows, device="cuda") for _ in range(2))
    moe_gemm(x, w.gate_up, plan, want, triton_cfg, activation=activation, gather=True, row_amax=rows_want)
    persistent_gate_up(x, w.gate_up, plan, got, dataclasses.replace(triton_cfg, engine="gluon"),
                       activation=activation, row_amax=rows_got)
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=2**-7 * float(want.float().abs().max()))
    torch.testing.assert_close(rows_got, rows_want, rtol=2**-7, atol=0.0)
    routed = plan.tile_expert.repeat_interleave(128)[: plan.padded_rows] >= 0
    assert (want[routed].float().abs().sum(dim=1) > 0).float().mean() > 0.5, "the tiles computed nothing"


@pytest.mark.parametrize("scheme", ["fp8_tensor", "fp8_token"])
@pytest.mark.parametrize("H, I", [(1024, 768), (384, 320), (128, 128), (256, 256)],
                         ids=["H1024", "H384-I320", "H128-I128", "H256-I256"])
def test_gluon_gate_up_gives_the_triton_bits(scheme, H, I):
    """The Gluon persistent gate_up GEMM (``GemmConfig.engine="gluon"``) against the Triton
    grouped GEMM on the same prefill tile: h at every position and the per-expert amax
    (fp8_tensor) or the row maxima (fp8_token, equal to max |h| of each routed row) bit for bit,
    with rows gathered from tokens repeated for their two routed rows (``a_row_div=2``), with
    one program per SM and with three (each walking hundreds of tiles, its loads running into the
    next tile's), for experts of 0-300 rows (an empty expert, last tiles of every height: those of
    at most 64 rows leave the second MMA warpgroup without real rows, which stores zeros), I a
    multiple of the 128-column tile and not (320), K of more steps than the ring's stages and of
    fewer (3 and 1), with every seventh token 400 times larger (gates beyond +-88, where exp(-gate)
    leaves the normal range: the Gluon epilogue flushes denormal exps and reciprocals, Triton's does
    not), and under CUDA-graph replay with new x. The one difference allowed: where 1 + exp(-gate)
    exceeds 2^126, the Gluon silu flushes to zero a product Triton leaves below 2^-100 (a zero
    where Triton's h is larger, or any other difference, fails). An H that is not a whole number
    of K steps is refused by name."""
    import dataclasses

    from moeshard.kernels.grouped_gemm import moe_gemm
    from moeshard.kernels.persistent_gate_up import persistent_gate_up

    E = 24
    counts = 2 * torch.randint(0, 150, (E,), generator=torch.Generator().manual_seed(5))
    counts[3] = 0
    tokens = torch.repeat_interleave(torch.arange(E), counts // 2)[torch.randperm(int(counts.sum()) // 2)]
    ids = tokens.repeat_interleave(2).cuda()  # each token's two routed rows go to one expert: fine for the GEMM
    M = ids.shape[0]
    w = _weights(E, H, I, torch.bfloat16, scheme, seed=11)
    spec = get_scheme(scheme)
    tokens_x = torch.randn(M // 2, H, device="cuda")
    # Rows large enough that exp(-gate) leaves the normal range both ways (gate beyond +-88):
    # denormal results, flushed by the Gluon epilogue's exp, and infinities.
    tokens_x[:: 7] *= 400.0
    x = quantize_activations(tokens_x.to(torch.bfloat16), scheme)
    plan = align_rows(ids, E, 128)
    triton_cfg = GemmConfig(128, 128, 128, 8, 8, 4, tma=True, fp8_acc="imprecise")
    gluon_cfg = dataclasses.replace(triton_cfg, engine="gluon")

    def run(cfg, programs=None):
        amax = torch.zeros(E, device="cuda") if spec.per_tensor_activation else None
        rows = None if spec.per_tensor_activation else torch.zeros(plan.padded_rows, device="cuda")
        h = torch.full((plan.padded_rows, I), float("nan"), dtype=torch.bfloat16, device="cuda")
        if programs is None:
            moe_gemm(x, w.gate_up, plan, h, cfg, activation="silu", gather=True, amax=amax, a_row_div=2,
                     row_amax=rows)
        else:
            persistent_gate_up(x, w.gate_up, plan, h, cfg, activation="silu", amax=amax, a_row_div=2,
                               programs=programs, row_amax=rows)
        return h, amax if rows is None else rows

    def same(got, want):
        # Tiles past the last expert's hold padding only and are written by neither kernel.
        if not torch.equal(got.isnan(), want.isnan()):
            return False
        got, want = got.nan_to_num(), want.nan_to_num()
        # The flushing reciprocal's zeros (see the docstring), and nothing else, may differ.
        flushed = (got != want) & (got == 0) & (want.float().abs() < 2.0 ** -100)
        return torch.equal(torch.where(flushed, want, got), want)

    want_h, want_amax = run(triton_cfg)
    assert not want_h[: plan.max_tiles * 128][plan.tile_expert.repeat_interleave(128) >= 0].isnan().any()
    # The inputs reach the ranges the large rows are for (gates of the first tokens with one
    # expert's weights, in fp32).
    gate = x.dequantize()[:128] @ w.gate_up.dequantize()[0, :I].T
    assert gate.max() > 90 and gate.min() < -90, f"gate range {gate.min():.3g}..{gate.max():.3g}"
    if not spec.per_tensor_activation:
        tile_of = plan.tile_expert.repeat_interleave(128).long()
        expert = tile_of.clamp(min=0)
        real = (tile_of >= 0) & (torch.arange(plan.padded_rows, device="cuda") - plan.start.long()[expert]
                                 < plan.count.long()[expert])
        assert torch.equal(want_amax[real], want_h[real].float().abs().amax(dim=1))
        assert (want_amax[~real] == 0).all()
    for programs in (None, 3):
        got_h, got_amax = run(gluon_cfg, programs)
        assert same(got_h, want_h), f"{scheme} H={H} I={I} programs={programs}: max " \
            f"{(got_h.float() - want_h.float()).nan_to_num().abs().max():.3g}"
        if want_amax is not None:
            assert torch.equal(got_amax, want_amax), f"{scheme} H={H} I={I} programs={programs}: amax / row maxima"
    odd = quantize_activations(torch.randn(M // 2, H + 64, device="cuda").to(torch.bfloat16), scheme)
    odd_w = _weights(E, H + 64, I, torch.bfloat16, scheme, seed=3).gate_up
    with pytest.raises(ValueError, match=f"H={H + 64} a multiple of its 128-column K step"):
        persistent_gate_up(odd, odd_w, plan, want_h, gluon_cfg, activation="silu", a_row_div=2)
    h = torch.empty(plan.padded_rows, I, dtype=torch.bfloat16, device="cuda")
    amax = torch.zeros(E, device="cuda") if spec.per_tensor_activation else None
    moe_gemm(x, w.gate_up, plan, h, gluon_cfg, activation="silu", gather=True, amax=amax, a_row_div=2)  # compiles
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        if amax is not None:
            amax.zero_()
        moe_gemm(x, w.gate_up, plan, h, gluon_cfg, activation="silu", gather=True, amax=amax, a_row_div=2)
    new = quantize_activations(torch.randn(M // 2, H, device="cuda").to(torch.bfloat16), scheme)
    x.data.copy_(new.data)
    (x.row_scale if x.row_scale is not None else x.tensor_scale).copy_(
        new.row_scale if new.row_scale is not None else new.tensor_scale)
    graph.replay()
    want_h, want_amax = run(triton_cfg)
    used = plan.tile_expert.repeat_interleave(128) >= 0
    assert torch.equal(h[: used.shape[0]][used], want_h[: used.shape[0]][used]), f"{scheme} H={H}: graph replay"
    if amax is not None:
        assert torch.equal(amax, want_amax), f"{scheme} H={H}: graph replay amax"


@pytest.mark.parametrize("block_n, stages", [(64, 4), (64, 6), (128, 3)], ids=["n64-s4", "n64-s6", "n128-s3"])
@pytest.mark.parametrize("H, I", [(1024, 768), (128, 128), (384, 256)], ids=["H1024", "H128-I128", "H384-I256"])
def test_gluon_gate_up_gives_the_triton_bits_for_fp8_block(H, I, block_n, stages):
    """The Gluon gate_up with fp8_block's 128 x 128 block scales (each K step's products scaled
    and added in fp32) against the Triton grouped GEMM's 128 x 128 x 128 tile: h bit for bit at
    every position the Triton kernel writes, in 64- and 128-column tiles, with one program per SM
    and with three, rows gathered from tokens repeated for two routed rows, experts of 0-300 rows,
    K of one step and of more steps than the ring's stages, and under CUDA-graph replay with new
    x. An intermediate size that is not a multiple of 128 (its up columns would straddle weight
    blocks) and an amax or row_amax buffer (fp8_block's h is quantized from h) are refused by
    name."""
    from moeshard.kernels.grouped_gemm import moe_gemm
    from moeshard.kernels.persistent_gate_up import persistent_gate_up

    E = 24
    counts = 2 * torch.randint(0, 150, (E,), generator=torch.Generator().manual_seed(6))
    counts[5] = 0
    tokens = torch.repeat_interleave(torch.arange(E), counts // 2)[torch.randperm(int(counts.sum()) // 2)]
    ids = tokens.repeat_interleave(2).cuda()
    M = ids.shape[0]
    w = _weights(E, H, I, torch.bfloat16, "fp8_block", seed=12)
    x = quantize_activations(torch.randn(M // 2, H, device="cuda").to(torch.bfloat16), "fp8_block")
    plan = align_rows(ids, E, 128)
    triton_cfg = GemmConfig(128, 128, 128, 8, 8, 3, tma=True)
    gluon_cfg = GemmConfig(128, block_n, 128, 8, 8, stages, tma=True, fp8_acc="imprecise", engine="gluon")

    def run(cfg, programs=None):
        h = torch.full((plan.padded_rows, I), float("nan"), dtype=torch.bfloat16, device="cuda")
        if programs is None:
            moe_gemm(x, w.gate_up, plan, h, cfg, activation="silu", gather=True, a_row_div=2)
        else:
            persistent_gate_up(x, w.gate_up, plan, h, cfg, activation="silu", a_row_div=2, programs=programs)
        return h

    def same(a, b):
        return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())

    want = run(triton_cfg)
    assert not want[: plan.max_tiles * 128][plan.tile_expert.repeat_interleave(128) >= 0].isnan().any()
    for programs in (None, 3):
        got = run(gluon_cfg, programs)
        assert same(got, want), f"H={H} I={I} block_n={block_n} programs={programs}: max " \
            f"{(got.float() - want.float()).nan_to_num().abs().max():.3g}"
    odd_w = _weights(E, H, I + 64, torch.bfloat16, "fp8_block", seed=3).gate_up
    odd_h = torch.empty(plan.padded_rows, I + 64, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match=f"fp8_block needs I={I + 64} a multiple of 128"):
        persistent_gate_up(x, odd_w, plan, odd_h, gluon_cfg, activation="silu", a_row_div=2)
    with pytest.raises(ValueError, match="no amax or row_amax; got amax given: False, row_amax given: True"):
        persistent_gate_up(x, w.gate_up, plan, want, gluon_cfg, activation="silu", a_row_div=2,
                           row_amax=torch.zeros(plan.padded_rows, device="cuda"))
    h = torch.empty(plan.padded_rows, I, dtype=torch.bfloat16, device="cuda")
    moe_gemm(x, w.gate_up, plan, h, gluon_cfg, activation="silu", gather=True, a_row_div=2)  # compiles
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        moe_gemm(x, w.gate_up, plan, h, gluon_cfg, activation="silu", gather=True, a_row_div=2)
    new = quantize_activations(torch.randn(M // 2, H, device="cuda").to(torch.bfloat16), "fp8_block")
    x.data.copy_(new.data)
    x.row_scale.copy_(new.row_scale)
    graph.replay()
    want = run(triton_cfg)
    used = plan.tile_expert.repeat_interleave(128) >= 0
    assert torch.equal(h[: used.shape[0]][used], want[: used.shape[0]][used]), f"H={H} block_n={block_n}: replay"


@pytest.mark.parametrize("H, engines", [(1024, ("triton", "gluon")), (2048, ("gluon", "gluon"))],
                         ids=["H1024", "H2048"])
def test_experts_take_the_gluon_gemms_at_prefill_with_the_same_bits(H, engines):
    """``TritonExperts`` on an H200-class GPU selects the Gluon down GEMM for fp8_tensor at a
    prefill shape with I <= GLUON_DOWN_MAX_K, and the Gluon gate_up from H = GLUON_GATE_UP_MIN_H;
    its output is the Triton-only config's. An input whose rows the Gluon gate_up cannot copy
    (rows 16-byte misaligned) runs the Triton gate_up instead, with the same output."""
    import dataclasses

    from moeshard.kernels.persistent_down import supported

    assert supported(torch.device("cuda")) == (torch.cuda.get_device_capability()[0] == 9)
    if not supported(torch.device("cuda")):
        pytest.skip("the Gluon GEMMs run on compute capability 9.x")
    M, E, I = 8192, 8, 1536
    sel = select_config(M, E, H, I, "fp8_tensor", gluon=True)
    assert (sel.gate_up.engine, sel.down.engine) == engines, sel
    w = _weights(E, H, I, torch.bfloat16, "fp8_tensor", seed=2)
    x = torch.randn(M, H, device="cuda").to(torch.bfloat16)
    ids = _ids(M, E, seed=4)
    xq = quantize_activations(x, "fp8_tensor")
    got = TritonExperts("silu", torch.bfloat16)(ExpertInput(xq, ids, padded=False), w)
    triton_only = ExpertsConfig(select_config(M, E, H, I, "fp8_tensor", gluon=False).gate_up,
                                dataclasses.replace(sel.down, engine="triton", num_stages=3))
    want = TritonExperts("silu", torch.bfloat16, triton_only)(ExpertInput(xq, ids, padded=False), w)
    assert torch.equal(got, want)
    wide = torch.zeros(M, H + 8, dtype=xq.data.dtype, device="cuda")
    wide[:, :H] = xq.data
    misaligned = dataclasses.replace(xq, data=wide[:, :H])
    assert misaligned.data.stride(0) % 16
    assert torch.equal(TritonExperts("silu", torch.bfloat16)(ExpertInput(misaligned, ids, padded=False), w), want)


@pytest.mark.parametrize("stages", [4, 6])
@pytest.mark.parametrize("H, I", [(1024, 768), (256, 128), (384, 384)], ids=["H1024", "H256-I128", "H384-I384"])
def test_gluon_block_down_gives_the_triton_bits(H, I, stages):
    """fp8_block's warp-specialized Gluon down GEMM (``kernels.persistent_block_down``) against
    the Triton grouped GEMM's selected prefill down tile (64 x 128 x 128 over the split plan): y
    bit for bit at every routed row, rows no tile writes left as they were, with one program per
    SM and with three, experts of 0-300 rows (last tiles whose second warpgroup holds padding
    only), K of one step and of more steps than the ring's stages, and under CUDA-graph replay
    with new h. A hidden size that is not a multiple of 128 is refused by name."""
    from moeshard.kernels.align import split_tiles
    from moeshard.kernels.grouped_gemm import moe_gemm
    from moeshard.kernels.persistent_block_down import persistent_block_down

    E = 24
    counts = torch.randint(0, 300, (E,), generator=torch.Generator().manual_seed(7))
    counts[2] = 0
    ids = torch.repeat_interleave(torch.arange(E), counts)[torch.randperm(int(counts.sum()))].cuda()
    M = ids.shape[0]
    w = _weights(E, H, I, torch.bfloat16, "fp8_block", seed=13)
    plan = align_rows(ids, E, 128)
    h = torch.randn(plan.padded_rows, I, device="cuda").to(torch.bfloat16)
    hq = quantize_h(h, "fp8_block", plan, None)
    triton_cfg = GemmConfig(64, 128, 128, 8, 4, 4, tma=True)
    gluon_cfg = GemmConfig(128, 128, 128, 8, 8, stages, tma=True, fp8_acc="imprecise", engine="gluon")

    def triton_y():
        y = torch.full((M, H), float("nan"), dtype=torch.bfloat16, device="cuda")
        moe_gemm(hq, w.down, split_tiles(plan, 64), y, triton_cfg, activation=None, gather=False)
        return y

    want = triton_y()
    assert not want.isnan().any()
    for programs in (None, 3):
        got = torch.full((M, H), float("nan"), dtype=torch.bfloat16, device="cuda")
        persistent_block_down(hq, w.down, plan, got, gluon_cfg, programs=programs)
        assert torch.equal(got, want), f"H={H} I={I} stages={stages} programs={programs}: max " \
            f"{(got.float() - want.float()).nan_to_num().abs().max():.3g}"
    odd_w = _weights(E, H + 64, I, torch.bfloat16, "fp8_block", seed=4).down
    with pytest.raises(ValueError, match=f"H={H + 64} and I={I} must be multiples of the tile's 128 columns"):
        persistent_block_down(hq, odd_w, plan, torch.empty(M, H + 64, dtype=torch.bfloat16, device="cuda"),
                              gluon_cfg)
    y = torch.empty(M, H, dtype=torch.bfloat16, device="cuda")
    moe_gemm(hq, w.down, plan, y, gluon_cfg, activation=None, gather=False)  # compiles
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        moe_gemm(hq, w.down, plan, y, gluon_cfg, activation=None, gather=False)
    new = quantize_h(torch.randn(plan.padded_rows, I, device="cuda").to(torch.bfloat16), "fp8_block", plan, None)
    hq.data.copy_(new.data)
    hq.row_scale.copy_(new.row_scale)
    graph.replay()
    assert torch.equal(y, triton_y()), f"H={H} I={I} stages={stages}: graph replay"


def test_fp8_block_experts_take_the_gluon_gemms_with_the_same_bits():
    """fp8_block ``TritonExperts`` at a prefill shape on an H200-class GPU select the Gluon gate_up
    with block scales (rows gathered, h quantized by quantize_h's pass) and the Gluon down GEMM
    with block scales, and give the output of the Triton-only config, which lays the input out
    and quantizes h in its gate_up (I >= 4096 at 1024 rows per expert), bit for bit."""
    from moeshard.kernels.persistent_down import supported

    if not supported(torch.device("cuda")):
        pytest.skip("the Gluon GEMMs run on compute capability 9.x")
    M, E, H, I = 8192, 8, 2048, 4096
    sel = select_config(M, E, H, I, "fp8_block", gluon=True)
    assert sel.gate_up.engine == sel.down.engine == "gluon" and not sel.lay_out_a and sel.h_quant == "pass", sel
    triton_only = select_config(M, E, H, I, "fp8_block", gluon=False)
    assert triton_only.lay_out_a and triton_only.h_quant == "gate_up", triton_only
    w = _weights(E, H, I, torch.bfloat16, "fp8_block", seed=21)
    xq = quantize_activations(torch.randn(M, H, device="cuda").to(torch.bfloat16), "fp8_block")
    inp = ExpertInput(xq, _ids(M, E, seed=22), padded=False)
    got = TritonExperts("silu", torch.bfloat16)(inp, w)
    want = TritonExperts("silu", torch.bfloat16, triton_only)(inp, w)
    assert torch.equal(got, want), f"max {(got.float() - want.float()).abs().max():.3g}"


@pytest.mark.parametrize("M, E, H, I, dtype", [(3000, 8, 512, 768, torch.bfloat16), (8192, 4, 1024, 1536, torch.float16),
                                                (600, 2, 256, 256, torch.bfloat16)],
                         ids=["half-tiles", "whole-tiles-fp16", "two-groups"])
def test_gate_up_quantizing_h_gives_the_pass_bits(M, E, H, I, dtype):
    """fp8_block prefill, compiled: gate_up storing h quantized (``moe_gemm``'s out_scale, the
    selected 128 x 128 x 128 TMA tile, half tiles where select_config takes them) gives
    quantize_h's values and scales at every position quantize_h writes, and the experts with
    ``h_quant='gate_up'`` the output of the separate pass, bit for bit."""
    import dataclasses

    from moeshard.kernels.grouped_gemm import moe_gemm

    sel = select_config(M, E, H, I, "fp8_block")
    assert sel.gate_up.block_n == 128 and sel.gate_up.tma, sel
    w = _weights(E, H, I, dtype, "fp8_block", seed=5)
    x = torch.randn(M, H, device="cuda").to(dtype)
    ids = _ids(M, E, seed=6)
    xq = quantize_activations(x, "fp8_block")
    plan = align_rows(ids, E, sel.block_m)
    h = torch.empty(plan.padded_rows, I, dtype=dtype, device="cuda")
    moe_gemm(xq, w.gate_up, plan, h, sel.gate_up, activation="silu", gather=True)
    want = quantize_h(h, "fp8_block", plan, None)
    q = torch.full((plan.padded_rows, I), 0x7F, dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)
    s = torch.full((plan.padded_rows, I // 128), float("nan"), device="cuda")
    moe_gemm(xq, w.gate_up, plan, q, sel.gate_up, activation="silu", gather=True, out_scale=s, h_dtype=dtype)
    # gate_up writes every position of its live tiles, quantize_h the row blocks holding rows
    tiles = (plan.tile_expert >= 0).repeat_interleave(sel.block_m)
    written = quantized_positions(plan)
    assert torch.equal(q.view(torch.uint8)[written], want.data.view(torch.uint8)[written])
    assert torch.equal(s[written], want.row_scale[written])
    assert (q.view(torch.uint8)[~tiles] == 0x7F).all() and s[~tiles].isnan().all()
    outs = [TritonExperts("silu", dtype, dataclasses.replace(sel, h_quant=where))(ExpertInput(xq, ids), w)
            for where in ("pass", "gate_up")]
    assert not outs[1].isnan().any() and torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("scheme", SCHEMES)
def test_laid_out_input_gives_the_gathered_bits(scheme):
    """gate_up on the input laid out at padded positions (``kernels.layout``, read through TMA by
    the prefill tiles but nvfp4's) against the gathered rows, compiled: 4 experts of about 1200 rows, tokens
    repeated for their two routed rows as the local backend passes them. h at every used position
    on one plan, the per-expert amax and the experts' y must be the same bits."""
    import dataclasses

    from moeshard.kernels.grouped_gemm import moe_gemm
    from moeshard.kernels.layout import lay_out_rows

    E, H, I, repeat, tokens = 4, 512, 384, 2, 2400
    w = _weights(E, H, I, torch.bfloat16, scheme, seed=9)
    x = torch.randn(tokens, H, device="cuda").to(torch.bfloat16)
    xin = quantize_activations(x, scheme) if scheme != "none" else x
    ids = _ids(tokens * repeat, E, seed=4)
    M = ids.shape[0]
    sel = dataclasses.replace(select_config(M, E, H, I, scheme), lay_out_a=False)
    assert sel.gate_up.block_m == 128 and (sel.gate_up.tma or scheme == "nvfp4"), sel  # nvfp4: pointer loads
    per_tensor = get_scheme(scheme).per_tensor_activation
    plan = align_rows(ids, E, 128)
    used = plan.tile_expert.long().repeat_interleave(128) >= 0
    hs = []
    for lay_out in (False, True):
        amax = torch.zeros(E, device="cuda") if per_tensor else None
        h = torch.full((plan.padded_rows, I), float("nan"), dtype=torch.bfloat16, device="cuda")
        a = lay_out_rows(xin, plan, repeat) if lay_out else xin
        moe_gemm(a, w.gate_up, plan, h, sel.gate_up, activation="silu", gather=not lay_out, amax=amax,
                 a_row_div=1 if lay_out else repeat)
        hs.append((h[used], amax))
    (h0, a0), (h1, a1) = hs
    assert not h1.isnan().any() and torch.equal(h0, h1), scheme
    assert a0 is None or torch.equal(a0, a1), scheme
    ys = [TritonExperts("silu", torch.bfloat16, dataclasses.replace(sel, lay_out_a=lay_out))(
          ExpertInput(xin, ids, repeat=repeat), w) for lay_out in (False, True)]
    assert torch.equal(ys[0], ys[1]), scheme


@pytest.mark.parametrize("decode", ["activations", "all"])
def test_decoded_nvfp4_operands_give_the_codes_bits(decode):
    """nvfp4 experts with the activations (and the weights, whole and a window of experts at a
    time) decoded to fp16 values before the GEMMs (``kernels.nvfp4_values``), compiled, at the
    prefill tiles: the decoded values are the e2m1 values times their block scales, and y is the
    codes' bit for bit, with pointer loads and through TMA."""
    import dataclasses

    from moeshard.kernels.nvfp4_values import nvfp4_values
    from moeshard.quant.nvfp4 import e2m1_decode, unpack_fp4

    E, H, I, M = 8, 512, 384, 3000
    w = _weights(E, H, I, torch.bfloat16, "nvfp4", seed=12)
    xq = quantize_activations(torch.randn(M, H, device="cuda").to(torch.bfloat16), "nvfp4")
    decoded = nvfp4_values(xq).values.float()
    assert torch.equal(decoded, e2m1_decode(unpack_fp4(xq.data)) * xq.row_scale.float().repeat_interleave(16, dim=1))
    ids = _ids(M, E, seed=13)
    sel = select_config(M, E, H, I, "nvfp4")
    assert sel.gate_up.block_m == 128, sel
    for tma in (False, True):
        tiles = dataclasses.replace(sel, gate_up=dataclasses.replace(sel.gate_up, tma=tma),
                                    down=dataclasses.replace(sel.down, tma=tma))
        y_codes = TritonExperts("silu", torch.bfloat16, dataclasses.replace(tiles, decode_nvfp4="off"))(
            ExpertInput(xq, ids), w)
        for window in (0, 3) if decode == "all" else (0,):  # whole, and windows of 3 of the 8 experts
            y = TritonExperts("silu", torch.bfloat16,
                              dataclasses.replace(tiles, decode_nvfp4=decode, decode_experts=window))(
                ExpertInput(xq, ids), w)
            assert torch.equal(y, y_codes), f"{decode} tma={tma} decode_experts={window}"


@pytest.mark.parametrize("chain", ["gate_up", "all", "all+prefetch"])
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("M", [1, 8, 128, 3000], ids=lambda m: f"M{m}")
def test_pdl_gives_the_same_bits(scheme, M, chain):
    """The experts launched with programmatic dependent launch against the same tiles launched
    one after another: the same y, eagerly and under graph replay with new inputs (a kernel that
    read before its wait would see the kernel ahead half done: tests/test_pdl_order.py checks
    the order in the machine code, this the results). "all+prefetch": the down GEMM also asks
    L2 for its weights before its wait (``ExpertsConfig.down_prefetch``). M=1: one token's row on
    the direct plan."""
    import dataclasses

    from moeshard.kernels import pdl

    if not pdl.supported(torch.device("cuda")):
        pytest.skip("needs compute capability 9.0+ (programmatic dependent launch)")
    E, H, I = 64, 1024, 512
    w = _weights(E, H, I, torch.bfloat16, scheme, seed=11)
    gen = torch.Generator(device="cuda").manual_seed(M)
    x = torch.randn(M, H, device="cuda", generator=gen).to(torch.bfloat16)
    ids = _ids(M, E, seed=M + 5)
    tiles = select_config(M, E, H, I, scheme)  # any chain on any tiles, prefill's TMA tiles included
    serial = TritonExperts("silu", torch.bfloat16, tiles)
    if chain == "all+prefetch":
        if tiles.down.engine != "triton" or tiles.gemv is not None:
            pytest.skip(f"the {tiles.down.engine} down GEMM is not launched under PDL, or no down GEMM prefetches "
                        f"(gemv: {tiles.gemv})")
        under = dataclasses.replace(tiles, pdl="all", down_prefetch=2 * I)  # more than K: a whole row
    else:
        under = dataclasses.replace(tiles, pdl=chain)
    kernel = TritonExperts("silu", torch.bfloat16, under)

    def quantized(t):
        return quantize_activations(t, scheme) if scheme != "none" else t

    assert torch.equal(kernel(ExpertInput(quantized(x), ids), w), serial(ExpertInput(quantized(x), ids), w)), \
        f"{scheme} M={M} {chain}: eager"
    static_x, static_ids = x.clone(), ids.clone()
    kernel(ExpertInput(quantized(static_x), static_ids), w)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = kernel(ExpertInput(quantized(static_x), static_ids), w)
    for seed in range(3):
        g = torch.Generator(device="cuda").manual_seed(100 + seed)
        static_x.copy_(torch.randn(M, H, device="cuda", generator=g).to(torch.bfloat16))
        static_ids.copy_(torch.randint(0, E, (M,), device="cuda", generator=g))
        graph.replay()
        want = serial(ExpertInput(quantized(static_x), static_ids), w)
        assert torch.equal(static_y, want), f"{scheme} M={M} {chain}: replay {seed}"


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh"])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_gelu_and_deferred_quantization(scheme, activation):
    M, E, H, I = SHAPES["mid"]
    dtype = torch.bfloat16
    w = _weights(E, H, I, dtype, scheme, seed=3)
    x = torch.randn(M, H, device="cuda", generator=torch.Generator(device="cuda").manual_seed(M + 2)).to(dtype)
    ids = _ids(M, E, seed=4)
    amax = x.abs().amax().float()
    # Deferred: model-dtype rows in, the kernel quantizes them with the layer-wide amax.
    kernel = TritonExperts(activation, dtype)
    y = kernel(ExpertInput(x, ids, amax if get_scheme(scheme).per_tensor_activation else None), w)
    xin = (quantize_activations(x, scheme, amax=amax if get_scheme(scheme).per_tensor_activation else None)
           if scheme != "none" else x)
    ref = expert_reference(xin, ids, w, activation, dtype, accumulation=kernel.accumulation(scheme))
    _check(y, ref, dtype, scheme, f"{activation} deferred {scheme}")


@pytest.mark.parametrize("scheme", ["fp8_tensor", "fp8_token", "fp8_block", "nvfp4"])
def test_quantize_h_bit_exact(scheme):
    E, I = 7, 1408
    ids = _ids(900, E, seed=5)
    amax = torch.zeros(E, device="cuda")
    plan = align_rows(ids, E, 64, amax=amax)
    h = (torch.randn(plan.padded_rows, I, device="cuda") * torch.exp(torch.randn(plan.padded_rows, 1, device="cuda"))
         ).to(torch.bfloat16)
    tile_of = plan.tile_expert.repeat_interleave(plan.block_m)
    amax.copy_(torch.zeros(E, device="cuda").scatter_reduce(0, tile_of.clamp(min=0).long(), h.float().abs().amax(1),
                                                            "amax", include_self=True))
    q = quantize_h(h, scheme, plan, amax)
    live = quantized_positions(plan)  # row blocks past each expert's last row are left unwritten
    row_amax = amax[tile_of.clamp(min=0).long()].unsqueeze(1)[live]
    ref = quantize_activations(h[live], scheme, amax=row_amax if get_scheme(scheme).per_tensor_activation else None)
    assert_same_quantization(q, ref, live)


@pytest.mark.parametrize("M, bm, block_n", [(48, 16, 128), (900, 64, 64), (3000, 128, 128)],
                         ids=["one-program-plan", "decode-128", "prefill"])
def test_gate_up_row_maxima_give_quantize_h_bits(M, bm, block_n):
    """fp8_token: the compiled Triton gate_up's row maxima (``row_amax``, zeroed by the plan: one
    program at 48 rows, the scatter kernel's programs above) equal max |h| of every routed row and
    are zero at padding positions, and ``quantize_h`` given them writes its own passes' bits."""
    from moeshard.kernels.align import max_tiles
    from moeshard.kernels.grouped_gemm import moe_gemm

    E, H, I = 8, 512, 1408
    w = _weights(E, H, I, torch.bfloat16, "fp8_token", seed=8)
    x = quantize_activations(torch.randn(M, H, device="cuda").to(torch.bfloat16), "fp8_token")
    ids = _ids(M, E, seed=9)
    rows = torch.full((max_tiles(M, E, bm) * bm,), float("nan"), device="cuda")
    plan = align_rows(ids, E, bm, row_amax=rows)
    h = torch.empty(plan.padded_rows, I, dtype=torch.bfloat16, device="cuda")
    moe_gemm(x, w.gate_up, plan, h, GemmConfig(bm, block_n, 128, 4, 8 if bm == 128 else 4, 3), activation="silu",
             gather=True,
             row_amax=rows)
    tile_of = plan.tile_expert.repeat_interleave(bm).long()
    expert = tile_of.clamp(min=0)
    real = (tile_of >= 0) & (torch.arange(plan.padded_rows, device="cuda") - plan.start.long()[expert]
                             < plan.count.long()[expert])
    assert torch.equal(rows[real], h[real].float().abs().amax(dim=1))
    assert (rows[~real] == 0).all()
    live = quantized_positions(plan)
    got = quantize_h(h, "fp8_token", plan, None, row_amax=rows)
    assert_same_quantization(got, quantize_activations(h[live], "fp8_token"), live)


@pytest.mark.parametrize("scheme, M, E, H, I", [
    *[(scheme, 3000, 8, 512, 768) for scheme in ("fp8_tensor", "fp8_token", "fp8_block")],
    *[(scheme, 256, 8, 512, 1408) for scheme in ("fp8_tensor", "fp8_token", "fp8_block", "nvfp4")]],
    ids=lambda v: str(v))
def test_down_ignores_the_positions_quantize_h_leaves(scheme, M, E, H, I):
    """Compiled, with the tiles select_config picks (the Gluon down GEMM where it takes the shape;
    a 64-row decode tile of about 32 rows): the row blocks quantize_h leaves unwritten (past each
    expert's last row) hold NaN values and scales, and y must be the bits it is with zeros there.
    (nvfp4's prefill decodes h to values before the down GEMM, so only its decode shape applies.)"""
    from moeshard.kernels.align import split_tiles
    from moeshard.kernels.experts import gluon_supported
    from moeshard.kernels.grouped_gemm import moe_gemm

    sel = select_config(M, E, H, I, scheme, gluon=gluon_supported(torch.device("cuda")))
    w = _weights(E, H, I, torch.bfloat16, scheme, seed=7)
    x = quantize_activations(torch.randn(M, H, device="cuda").to(torch.bfloat16), scheme)
    ids = _ids(M, E, seed=8)
    plan = align_rows(ids, E, sel.block_m)
    amax = torch.zeros(E, device="cuda") if get_scheme(scheme).per_tensor_activation else None
    h = torch.empty(plan.padded_rows, I, dtype=torch.bfloat16, device="cuda")
    moe_gemm(x, w.gate_up, plan, h, sel.gate_up, activation="silu", gather=True, amax=amax)
    q = quantize_h(h, scheme, plan, amax)
    skipped = ~quantized_positions(plan)
    assert skipped[(plan.tile_expert >= 0).repeat_interleave(sel.block_m)].any()
    ys = []
    for nan in (False, True):
        for t in [q.data] + [t for t in (q.row_scale, q.tensor_scale) if t is not None and t.dim() == 2]:
            if t.dtype.is_floating_point and t.element_size() > 1:
                t[skipped] = float("nan") if nan else 0.0
            else:  # fp8 values, nvfp4 codes and e4m3 scales: bytes (0x7F is an e4m3 NaN)
                t.view(torch.uint8)[skipped] = 0x7F if nan else 0
        y = torch.full((M, H), float("nan"), dtype=torch.bfloat16, device="cuda")
        moe_gemm(q, w.down, split_tiles(plan, sel.down.block_m), y, sel.down, activation=None, gather=False)
        ys.append(y)
    assert not ys[0].isnan().any() and torch.equal(ys[0], ys[1])


@pytest.mark.parametrize("scheme", ["fp8_tensor", "fp8_token", "fp8_block", "nvfp4"])
@pytest.mark.parametrize("shape", [(1, 4096), (37, 2880), (4096, 7168)], ids=str)
def test_fused_input_quantization_bit_exact(scheme, shape):
    """The layer's input quantized in one fused pass equals ``quantize_activations`` bit for bit
    on the GPU: magnitudes over twelve decades (e4m3 subnormals among them), the own amax and a
    given domain amax (larger, or 0); and the layer on CUDA takes this path."""
    from moeshard.kernels import fused_input_quant
    from moeshard.kernels.quant_rows import input_amax, quantize_rows
    from moeshard.quant.fp8 import abs_amax

    T, K = shape
    x = (torch.randn(T, K, device="cuda") * torch.logspace(-8, 4, K, device="cuda")[torch.randperm(K, device="cuda")]
         ).to(torch.bfloat16)
    assert torch.equal(input_amax(x), abs_amax(x, (0, 1)))
    domain = [None, abs_amax(x, (0, 1)) * 2, torch.zeros((), device="cuda")]  # 0: the floor's scale
    if scheme == "fp8_tensor":
        domain.append(torch.tensor(float("inf"), device="cuda"))  # an infinite scale, as torch divides
    for amax in (domain if scheme in ("fp8_tensor", "nvfp4") else [None]):
        got, want = quantize_rows(x, scheme, amax=amax), quantize_activations(x, scheme, amax=amax)
        for a, b in ((got.data, want.data), (got.row_scale, want.row_scale), (got.tensor_scale, want.tensor_scale)):
            assert (a is None) == (b is None)
            if a is not None:
                assert a.shape == b.shape and torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a,
                                                          b.view(torch.uint8) if b.element_size() == 1 else b)
    assert fused_input_quant(x.device, scheme) and not fused_input_quant(x.device, "none")


def test_router_topk_kernel_matches_the_stable_sort():
    """The router's one-pass top-k on CUDA gives the stable sort's indices (ties, NaN of either
    sign, -inf, -0.0 beside 0.0), and
    routing on the GPU picks the experts the CPU's sort picks, group-limited routing (by the
    best two and by the best one) and a selection bias included, with the CPU's weights
    (renormalized and scaled in the same pass on the GPU)."""
    from moeshard.kernels.topk import topk_low_index_first
    from moeshard.router import route

    s = (torch.randn(5000, 256, device="cuda") * 4).round() / 4
    s[0, :3] = float("nan")
    s[0, 5] = -s[0, 0]  # a NaN with its sign bit set ranks as any NaN
    s[1, ::2] = float("-inf")
    s[2] = torch.where(torch.arange(256, device="cuda") % 3 == 0, -0.0, 0.0)  # equal scores: lower column first
    for k in (1, 2, 8):
        # The CPU's stable sort is what the reference routes with.
        want = torch.sort(s.cpu(), dim=-1, descending=True, stable=True).indices[:, :k]
        assert torch.equal(topk_low_index_first(s, k).cpu(), want), k
    for preset in ("deepseek-v3", "qwen3-30b-a3b", "mixtral-8x7b", "deepseek-v2", "ernie-4.5-21b-a3b"):
        cfg = PRESETS[preset].config("full", torch.bfloat16)  # only its routing: no weights are made
        logits = (torch.randn(999, cfg.num_experts, device="cuda") * 2).round() / 2  # many ties
        bias = torch.randn(cfg.num_experts, device="cuda") * 0.1 if cfg.use_correction_bias else None
        gpu = route(logits, cfg, bias)
        cpu = route(logits.cpu(), cfg, None if bias is None else bias.cpu())
        assert torch.equal(gpu.topk_ids.cpu(), cpu.topk_ids), preset
        # The weights come from the same pass on the GPU (kernels.topk: sigmoid_topk for
        # DeepSeek-V3, softmax_topk, whose exponential is the GPU's fast one, for Qwen3, Mixtral
        # and ERNIE, its selection bias in it); DeepSeek-V2's 160 experts in groups keep the
        # torch ops (the pass takes groups of a power-of-two E).
        assert torch.allclose(gpu.topk_weights.cpu(), cpu.topk_weights, rtol=1e-5, atol=0), preset


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_sigmoid_routing_in_one_pass_is_the_torch_ops(dtype):
    """DeepSeek-V3's routing on CUDA runs in one pass (``kernels.topk.sigmoid_topk``: the sigmoid,
    the bias, the groups, the top k, the weights): the ids the router's torch ops pick on the
    same GPU (logits with many ties, a NaN row, a row whose best two groups tie), and, without
    renormalization and scaling, their weights bit for bit (the sigmoid is torch's CUDA one);
    with them, within an ulp of the sum's order. Also without groups and without the bias."""
    import dataclasses

    from moeshard.kernels.topk import Groups, routing_supported
    from moeshard.router import _routing_in_kernel, select_experts

    base = PRESETS["deepseek-v3"].config("full", torch.bfloat16)
    g = torch.Generator(device="cuda").manual_seed(5)
    logits = ((torch.randn(3000, base.num_experts, device="cuda", generator=g) * 8).round() / 4).to(dtype)
    logits[0] = float("nan")
    logits[1, 32:64] = logits[1, :32]
    bias = torch.randn(base.num_experts, device="cuda", generator=g) * 0.05
    variants = [base, dataclasses.replace(base, renormalize=False, routed_scaling_factor=1.0),
                dataclasses.replace(base, n_group=1, topk_group=1),
                dataclasses.replace(base, use_correction_bias=False)]
    for cfg in variants:
        b = bias if cfg.use_correction_bias else None
        assert _routing_in_kernel(logits, cfg, b) is not None  # the one-pass path applies
        fused = select_experts(logits, cfg, b)
        # The torch ops: logits that require grad keep every step in torch on the same GPU.
        with torch.enable_grad():
            ops = select_experts(logits.float().clone().requires_grad_(), cfg, b)
        assert torch.equal(fused.topk_ids[1:], ops.topk_ids[1:]), cfg
        assert torch.equal(fused.topk_ids[0], torch.arange(cfg.top_k, device="cuda"))  # NaN row: the first k
        want = ops.topk_weights.detach()
        if cfg.renormalize or cfg.routed_scaling_factor != 1.0:
            torch.testing.assert_close(fused.topk_weights, want, rtol=4 * 2.0**-23, atol=0, equal_nan=True)
        else:
            assert torch.equal(fused.topk_weights[1:], want[1:])
    assert not routing_supported(logits[:, :200], 8, None, Groups(8, 4))  # 200 experts: the torch ops


@pytest.mark.parametrize("preset", ["qwen3-30b-a3b", "mixtral-8x7b"])
def test_softmax_routing_from_model_dtype_logits(preset):
    """route_tokens on CUDA with bf16 logits (``router_dtype="model"``) routes in one pass from
    the bf16 logits (``kernels.topk.softmax_topk``): the experts the CPU's torch ops pick from the
    same logits, weights within 1e-5, and the bf16 logits kept in the Routing."""
    import dataclasses

    from moeshard.router import route_tokens, router_logits, select_experts

    cfg = dataclasses.replace(PRESETS[preset].config("full", torch.bfloat16), router_dtype="model")
    g = torch.Generator(device="cuda").manual_seed(7)
    x = torch.randn(4096, cfg.hidden_size, device="cuda", generator=g).bfloat16()
    w = (torch.randn(cfg.num_experts, cfg.hidden_size, device="cuda", generator=g) / 64).bfloat16()
    gpu = route_tokens(x, w, cfg)
    logits = router_logits(x, w, "model", widen=False)
    assert gpu.logits is not None and gpu.logits.dtype == torch.bfloat16 and torch.equal(gpu.logits, logits)
    cpu = select_experts(logits.cpu(), cfg, None)
    assert torch.equal(gpu.topk_ids.cpu(), cpu.topk_ids)
    assert torch.allclose(gpu.topk_weights.cpu(), cpu.topk_weights, rtol=1e-5, atol=0)


def test_align_plan():
    """The plan against its definition, each expert's rows in input order (the scatter ranks rows
    rather than counting them in with atomics, whose order varies from run to run), on the GPU
    where the scatter programs run at once. One program up to ONE_PROGRAM_ROWS ids (the first
    four), three kernels above; 131072 ids over 128 and 256 experts are Qwen3's and DeepSeek-V3's
    16384-token prefill."""
    for M, E, bm in ((1, 256, 16), (2, 8, 16), (64, 256, 16), (50, 8, 64), (128, 256, 16), (513, 256, 16),
                     (40000, 8, 128), (777, 33, 64), (131072, 128, 128), (131072, 256, 128)):
        ids = _ids(M, E, seed=M)
        plan = align_rows(ids, E, bm)
        counts = torch.bincount(ids, minlength=E)
        assert torch.equal(plan.count.long(), counts)
        assert int((plan.start % bm).abs().sum()) == 0
        tiles = plan.tile_expert.tolist()
        for e in range(E):
            s, c = int(plan.start[e]), int(counts[e])
            got = plan.sorted_rows[s:s + c].long()
            assert torch.equal(got, (ids == e).nonzero().flatten()), f"M={M}: expert {e}"
            assert tiles[s // bm:(s + c + bm - 1) // bm] == [e] * ((c + bm - 1) // bm)
        used = sum((int(c) + bm - 1) // bm for c in counts)
        assert tiles[used:] == [-1] * (len(tiles) - used)


def test_load_counter_records_on_the_device_and_under_graph_replay():
    """The compiled record pass (kernels/loads.py) against bincount, every row of the ring, over
    one program and up to 128 programs whose last to arrive writes their summed counts (40
    records, each checked: a row read before another program's counts were visible would
    differ); the running counts and arrivals zero after each; the layer's counter advances once
    per CUDA-graph replay."""
    from moeshard.eplb.loads import LoadCounter

    E, window = 256, 3
    counter = LoadCounter(E, window, device="cuda")
    want = torch.zeros(window, E, dtype=torch.int64, device="cuda")
    sizes = (1, 5000, 131072, 7) + (131072, 65536, 4097) * 12
    for i, M in enumerate(sizes):
        ids = _ids(M, E, seed=i).view(-1, 1)
        counter.record(ids)
        want[i % window] = torch.bincount(ids.view(-1), minlength=E)
        assert torch.equal(counter.ring, want) and int(counter.step) == i + 1, f"record {i}, {M} ids"
        assert not counter.pending.any()
    cfg, _, layer = _layer("qwen3-30b-a3b", "none")
    x = torch.randn(40, cfg.hidden_size, device="cuda").to(cfg.dtype)
    graph, _ = _captured(layer, x)
    before = int(layer.loads.step)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert int(layer.loads.step) == before + 3
    assert int(layer.expert_loads(all_reduce=False).sum()) == min(before + 3, layer.loads.window) * 40 * cfg.top_k


def test_combine_topk():
    y = torch.randn(3000 * 8, 1000, device="cuda").to(torch.bfloat16)
    w = torch.rand(3000, 8, device="cuda")
    ref = (y.view(3000, 8, 1000).double() * w.double()[..., None]).sum(1)
    assert (combine_topk(y, w).double() - ref).abs().max() < 1e-4
    # Finishing the layer's sum on CUDA: the shared rows added in fp32 and one rounding, bit for
    # bit the fp32 combine then torch's mixed add (or cast).
    shared = torch.randn(3000, 1000, device="cuda").to(torch.bfloat16)
    fp32 = combine_topk(y, w)
    assert torch.equal(combine_topk(y, w, addend=shared, out_dtype=torch.bfloat16),
                       torch.add(fp32, shared, out=torch.empty_like(shared)))
    assert torch.equal(combine_topk(y, w, out_dtype=torch.bfloat16), fp32.to(torch.bfloat16))


def test_layer_final_combine_is_the_separate_sum():
    """The layer's forward on CUDA finishes in the combine (shared experts added, rounded once):
    the same bits as with the stage recorder on, which keeps the fp32 combine and the separate sum."""
    from moeshard.stages import StageRecorder

    for preset in ("deepseek-v3", "qwen3-30b-a3b"):
        cfg, weights, layer = _layer(preset, "none")
        recorded = MoELayer(cfg, QuantConfig("none"), weights=weights, device="cuda", recorder=StageRecorder())
        x = torch.randn(200, cfg.hidden_size, device="cuda").to(cfg.dtype)
        assert torch.equal(layer(x), recorded(x)), preset


@pytest.mark.parametrize("preset", ["qwen3-30b-a3b", "deepseek-v3"])
@pytest.mark.parametrize("scheme", ["fp8_tensor", "nvfp4", "fp8_token"])
def test_layer_makes_the_payload_while_it_routes(preset, scheme):
    """On CUDA the layer takes a per-tensor scheme's amax and quantization on a side stream while
    it routes (the local backend's ``payload_first``; DeepSeek-V3's shared experts on a third):
    the same bits as with ``overlap_payload`` off, which makes the payload at dispatch, eager at 1
    and 300 tokens and in a replayed CUDA graph; every such forward took the side stream's
    payload, and a per-row scheme's none."""
    cfg, weights, layer = _layer(preset, scheme)
    serial = MoELayer(cfg, QuantConfig(scheme), weights=weights, device="cuda")
    serial.overlap_payload = False
    taken = []
    dispatch_payload = layer.backend.dispatch_payload

    def spy(x, payload, routing):
        taken.append(x.shape[0])
        return dispatch_payload(x, payload, routing)

    layer.backend.dispatch_payload = spy  # an instance attribute: this layer's backend only
    for T in (1, 300):
        x = torch.randn(T, cfg.hidden_size, device="cuda").to(cfg.dtype)
        assert torch.equal(layer(x), serial(x)), (preset, scheme, T)
    static_x = torch.randn(48, cfg.hidden_size, device="cuda").to(cfg.dtype)
    graph, static_out = _captured(layer, static_x)
    static_x.copy_(torch.randn(48, cfg.hidden_size, device="cuda").to(cfg.dtype))
    graph.replay()
    assert torch.equal(static_out, serial(static_x)), (preset, scheme, "graph")
    # Two eager forwards, the warm-up, the capture.
    assert taken == ([1, 300, 48, 48] if scheme in ("fp8_tensor", "nvfp4") else []), taken


def test_a_backend_assigned_after_build_makes_and_dispatches_the_payload():
    """``layer.backend`` replaced after the layer is built (as the planted faults and the EPLB
    check do): the CUDA forward makes and dispatches the payload through the new backend, not
    through methods bound at construction."""
    cfg, weights, layer = _layer("qwen3-30b-a3b", "fp8_tensor")
    x = torch.randn(5, cfg.hidden_size, device="cuda").to(cfg.dtype)
    want = layer(x)
    calls = []

    class Counting(type(layer.backend)):
        def payload(self, *args, **kwargs):
            calls.append("payload")
            return super().payload(*args, **kwargs)

        def dispatch_payload(self, *args, **kwargs):
            calls.append("dispatch_payload")
            return super().dispatch_payload(*args, **kwargs)

    layer.backend = Counting(layer.backend.ctx)
    assert torch.equal(layer(x), want)
    assert calls == ["payload", "dispatch_payload"], calls


def _captured(layer, x: torch.Tensor, warmups: int = 1):
    """(a CUDA graph of ``layer(x)``, its output), captured after ``warmups`` calls on a side
    stream (as torch asks before a capture: kernels compiled, caches filled)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmups):
            layer(x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer(x)
    return graph, out


def _forward_without_host_sync(layer, x: torch.Tensor) -> None:
    """Runs ``layer(x)`` once to compile its kernels and fill its caches, then again with torch's
    sync debug mode set to fail on any device-to-host synchronization."""
    layer(x)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        layer(x)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def _layer(preset: str, scheme: str, dtype=torch.bfloat16, seed=0):
    cfg = PRESETS[preset].config("small", dtype)
    weights = MoEWeights.random(cfg, generator=torch.Generator().manual_seed(seed))
    layer = MoELayer(cfg, QuantConfig(scheme), weights=weights, device="cuda")
    return cfg, weights, layer


@pytest.mark.parametrize("preset", ["mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3"])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_layer_matches_reference(preset, scheme):
    """The layer on the Triton kernels within the tolerance table plus the reference's slack for
    the roundings the kernel's declared accumulation error leaves in doubt."""
    cfg, weights, layer = _layer(preset, scheme)
    assert type(layer.kernel).__name__ == "TritonExperts"
    for T in (1, 5, 300):
        x = torch.randn(T, cfg.hidden_size, generator=torch.Generator().manual_seed(T)).to(cfg.dtype)
        ref = reference_forward(x, weights, cfg, QuantConfig(scheme), accumulation=layer.accumulation)
        _check(layer(x.cuda()).cpu(), ref, cfg.dtype, scheme, f"layer {preset} {scheme} T={T}")


@pytest.mark.parametrize("routed, shared", [("fp8_block", "fp8_block"), ("fp8_tensor", "fp8_token")])
def test_layer_with_quantized_shared_experts(routed, shared):
    """Shared experts quantized (``QuantConfig.shared``) run as one expert of the Triton kernels:
    within the reference's bound (the shared MLP quantized the same way), no host sync, and a
    CUDA graph's replay gives eager's bits."""
    cfg = PRESETS["deepseek-v3"].config("small", torch.bfloat16)
    weights = MoEWeights.random(cfg, generator=torch.Generator().manual_seed(3))
    quant = QuantConfig(routed, shared=shared)
    layer = MoELayer(cfg, quant, weights=weights, device="cuda")
    assert layer.shared_experts is not None and layer.shared_experts.quantized is not None
    assert type(layer.shared_experts.quantized.kernel).__name__ == "TritonExperts"
    for T in (1, 5, 300):
        x = torch.randn(T, cfg.hidden_size, generator=torch.Generator().manual_seed(T)).to(cfg.dtype)
        ref = reference_forward(x, weights, cfg, quant, accumulation=layer.accumulation)
        _check(layer(x.cuda()).cpu(), ref, cfg.dtype, routed, f"layer {quant.name} T={T}")
    static_x = torch.randn(48, cfg.hidden_size, device="cuda").to(cfg.dtype)
    _forward_without_host_sync(layer, static_x)
    graph, static_out = _captured(layer, static_x)
    static_x.copy_(torch.randn(48, cfg.hidden_size, device="cuda").to(cfg.dtype))
    graph.replay()
    assert torch.equal(static_out, layer(static_x))


@pytest.mark.parametrize("scheme", SCHEMES)
def test_layer_forward_has_no_host_sync(scheme):
    cfg, _, layer = _layer("deepseek-v3", scheme)
    _forward_without_host_sync(layer, torch.randn(64, cfg.hidden_size, device="cuda").to(cfg.dtype))


@pytest.mark.parametrize("scheme", SCHEMES)
def test_layer_cuda_graph_replay(scheme):
    cfg, _, layer = _layer("deepseek-v3", scheme)
    static_x = torch.randn(48, cfg.hidden_size, device="cuda").to(cfg.dtype)
    graph, static_out = _captured(layer, static_x, warmups=3)
    for seed in range(3):
        new_x = torch.randn(48, cfg.hidden_size, device="cuda", generator=torch.Generator("cuda").manual_seed(seed))
        static_x.copy_(new_x.to(cfg.dtype))
        graph.replay()
        eager = layer(static_x)
        # Rows are computed independently of their placement within a tile, so replay and eager
        # agree bit for bit.
        assert torch.equal(static_out, eager), f"replay {seed}: max |diff| {(static_out - eager).abs().max()}"


def _tuning_candidates():
    """Every (scheme, gemm, config) the tile sweep may pick, once each."""
    if not CUDA:
        return []
    seen = {}
    for scheme, _, _, cands in SWEEPS:
        for gemm, configs in cands.items():
            for c in configs:
                seen[(scheme, gemm, c)] = None
    return list(seen)


@pytest.mark.parametrize("scheme,gemm,config", _tuning_candidates(),
                         ids=lambda v: v if isinstance(v, str) else "x".join(map(str, v.as_dict().values())))
def test_tuning_candidates_match_reference(scheme, gemm, config):
    """Every sweep candidate computes the same function (and, run first with pytest -n, compiles
    the sweep's kernels in parallel into Triton's cache). K = 512 keeps EVEN_K as at full size."""
    E, H, I = 8, 512, 512
    M = 64 if config.block_m <= 32 else 2048
    dtype = torch.bfloat16
    if gemm.startswith("gate_up"):
        cfg = ExpertsConfig(config, config)
    else:
        cfg = ExpertsConfig(GemmConfig(config.block_m, 64, config.block_k, 1, 4, 2), config)
    w = _weights(E, H, I, dtype, scheme, seed=11)
    x = torch.randn(M, H, device="cuda", generator=torch.Generator(device="cuda").manual_seed(M + 2)).to(dtype)
    ids = _ids(M, E, seed=12)
    xin = quantize_activations(x, scheme) if scheme != "none" else x
    kernel = TritonExperts("silu", dtype, cfg, fp8_gate_up="exact" if gemm == "gate_up" else "mma")
    y = kernel(ExpertInput(xin, ids), w)
    ref = expert_reference(xin, ids, w, "silu", dtype, accumulation=kernel.accumulation(scheme))
    _check(y, ref, dtype, scheme, f"{scheme} {gemm} {config}")


def test_select_kernel():
    assert type(select_kernel("silu", torch.bfloat16, torch.device("cuda"), "fp8_block")).__name__ == "TritonExperts"
    assert type(select_kernel("silu", torch.float32, torch.device("cuda"), "none")).__name__ == "GroupedExperts"
    assert select_config(512, 256, 7168, 2048, "none").block_m == 16
    assert select_config(128, 8, 4096, 14336, "none").block_m == 32
    assert select_config(131072, 256, 7168, 2048, "none").block_m == 128


@pytest.mark.parametrize("activation", ["silu", "gelu", "gelu_tanh", "swiglu_clamped", "silu_clamped"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_training_forward_of_grouped_experts_matches_the_torch_path(activation, dtype):
    """A CUDA forward that carries gradients runs the one-pass gated activation and its
    backward (``kernels/glu.py``) and gathers a token's K rows through ``RepeatedRows``: its
    output and its gradients of x and both weights equal the same pipeline on the CPU (plain
    torch ops), within the rounding of the model dtype."""
    from moeshard.activations import get_activation
    from moeshard.experts import GroupedExperts

    gen = torch.Generator().manual_seed(3)
    T, K, E, H, I = 300, 4, 8, 256, 384
    x = torch.randn(T, H, generator=gen).to(dtype)
    # The clamped kinds' products reach past their limit (about a third of them).
    scale = get_activation(activation).params.get("limit", 1.0)
    w13 = (torch.randn(E, 2 * I, H, generator=gen) * (scale / H**0.5)).to(dtype)
    w2 = (torch.randn(E, H, I, generator=gen) / I**0.5).to(dtype)
    ids = torch.randint(0, E, (T * K,), generator=gen)
    g = torch.randn(T * K, H, generator=gen).to(dtype)
    results = []
    for device in ("cuda", "cpu"):
        leaves = [t.to(device).requires_grad_(True) for t in (x, w13, w2)]
        y = GroupedExperts(activation, dtype)(ExpertInput(leaves[0], ids.to(device), repeat=K, padded=False),
                                              ExpertWeights(leaves[1], leaves[2]))
        results.append([t.float().cpu() for t in (y, *torch.autograd.grad(y, leaves, g.to(device)))])
    for name, a, b in zip(("y", "dx", "dw13", "dw2"), *results, strict=True):
        scale = float(b.abs().max())
        bound = (2e-2 if dtype == torch.bfloat16 else 1e-4) * scale
        assert float((a - b).abs().max()) <= bound, (name, float((a - b).abs().max()), bound)


@pytest.mark.parametrize("K", [2, 8])
def test_combine_backward_matches_the_torch_path(K):
    """The compiled one-pass combine backward (what the local, all2all and low_latency backends'
    backward run on CUDA) against ``pair_rows_backward``'s torch path on the CPU."""
    from moeshard.dispatch.base import pair_rows_backward
    from moeshard.dispatch.combine_kernel import combine_topk_backward

    gen = torch.Generator().manual_seed(K)
    T, H = 333, 2048
    grad_out = torch.randn(T, H, generator=gen)
    picked = torch.randn(T * K, H, generator=gen).to(torch.bfloat16)
    w = torch.rand(T, K, generator=gen)
    got_rows, got_w = combine_topk_backward(grad_out.cuda(), picked.cuda(), w.cuda())
    want_rows, want_w = pair_rows_backward(grad_out, picked, w)
    assert torch.equal(got_rows.cpu(), want_rows)
    torch.testing.assert_close(got_w.cpu(), want_w, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp32_router_on_tensor_cores_is_at_least_as_close_to_exact(dtype):
    """router_dtype fp32 on CUDA with 16-bit x and W runs ``chunked_logits`` (exact products,
    fp32 sums of K chunks): no farther from the exact logits than the fp32 GEMM it replaces
    (DeepSeek-V3's router shape); with gradients wanted it keeps the fp32 GEMM."""
    from moeshard.router import _tensor_core_chunk, router_logits

    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(4096, 7168, device="cuda", generator=gen).to(dtype)
    w = (torch.randn(256, 7168, device="cuda", generator=gen) / 7168**0.5).to(dtype)
    bias = torch.randn(256, device="cuda", generator=gen)
    exact = x.double() @ w.double().T + bias.double()
    fp32 = torch.nn.functional.linear(x.float(), w.float(), bias)
    assert _tensor_core_chunk(x, w) == 512
    ours = router_logits(x, w, "fp32", bias)
    err, err_fp32 = float((ours.double() - exact).abs().max()), float((fp32.double() - exact).abs().max())
    assert ours.dtype == torch.float32 and err <= err_fp32, (err, err_fp32)
    assert _tensor_core_chunk(x.requires_grad_(True), w) is None
    assert _tensor_core_chunk(x.detach(), w.float()) is None and _tensor_core_chunk(x.detach()[:, :100], w[:, :100]) is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_glu_kernels_of_every_gated_mode_match_autograd_through_activate(dtype):
    """The training forward's one-pass activation and its backward (``kernels/glu.py``), compiled,
    for every gated kind with a kernel mode, against ``activate`` and autograd through it on the
    GPU: equal up to fp32 rounding of the transcendental functions. The products reach past each
    kind's limit or up cap, so a clamp or a cap left out fails; the interpreter runs the same
    comparison on the CPU (tests/test_kernels.py)."""
    from moeshard.activations import activation_names, get_activation
    from moeshard.experts.base import activate
    from moeshard.kernels.glu import glu_backward, glu_forward

    gen = torch.Generator(device="cuda").manual_seed(5)
    for name in activation_names():
        kind = get_activation(name)
        if not kind.gated or kind.kernel_mode is None:
            continue
        reach = kind.params.get("limit", kind.params.get("up_cap", 3.0))
        gate_up = (torch.randn(301, 2 * 1000, device="cuda", generator=gen) * reach).to(dtype)
        grad_h = torch.randn(301, 1000, device="cuda", generator=gen).to(dtype)
        ref_in = gate_up.clone().requires_grad_(True)
        ref_h = activate(ref_in, name, dtype)
        (ref_grad,) = torch.autograd.grad(ref_h, ref_in, grad_h)
        rtol = 2**-7 if dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(glu_forward(gate_up, name, dtype), ref_h.detach(), rtol=rtol,
                                   atol=rtol * float(ref_h.detach().abs().max()), msg=lambda m, n=name: f"{n}: {m}")
        torch.testing.assert_close(glu_backward(gate_up, grad_h, name), ref_grad, rtol=rtol,
                                   atol=rtol * float(ref_grad.abs().max()), msg=lambda m, n=name: f"{n}: {m}")
