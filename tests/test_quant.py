"""Tests of moeshard.quant: known values, error bounds, layouts, slicing, wire views.

Expected scales and bounds are computed here from the documented conventions with plain loops
or hand arithmetic, not by calling the helpers under test. Round trips also run on CUDA when it
is available, where the quantize paths must not synchronize with the host.
"""

from __future__ import annotations

import math

import pytest
import torch

from moeshard.quant import (
    AMAX_FLOOR,
    E2M1_VALUES,
    FP8_DTYPE,
    SCHEMES,
    QuantizedActivations,
    QuantizedWeight,
    e2m1_decode,
    e2m1_encode,
    fake_quantize_activations,
    from_wire,
    pack_fp4,
    quantize_activations,
    quantize_weight,
    swizzle_scales,
    swizzled_shape,
    to_wire,
    unpack_fp4,
    unswizzle_scales,
)
from moeshard.quant.schemes import BUILTIN_SCHEMES

CUDA = torch.cuda.is_available()
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not CUDA, reason="CUDA is not available"))]
FLOAT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _rand(*shape: int, dtype=torch.float32, device="cpu", seed=0, spread=2.0) -> torch.Tensor:
    """Normal values whose magnitude varies from row to row by ``exp(spread * N(0, 1))``
    (exercises per-row scales)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=gen)
    if x.dim() >= 2:
        x = x * torch.exp(spread * torch.randn(*shape[:-1], 1, generator=gen))
    return x.to(dtype).to(device)


def _tile_amax(x: torch.Tensor, br: int, bc: int) -> torch.Tensor:
    """Per-element amax of the br x bc tile (over the last two dims) holding the element; plain loops."""
    out = torch.empty(x.shape, dtype=torch.float32)
    xf = x.float().cpu()
    rows, cols = x.shape[-2:]
    for r in range(0, rows, br):
        for c in range(0, cols, bc):
            tile = xf[..., r:r + br, c:c + bc]
            out[..., r:r + br, c:c + bc] = tile.abs().amax(dim=(-2, -1), keepdim=True)
    return out


def _fp8_group_amax(x: torch.Tensor, scheme: str, weight: bool) -> torch.Tensor:
    """Per-element amax of the element's fp8 scale group, from the documented grouping."""
    xf = x.float().cpu()
    if scheme == "fp8_tensor":
        dims = (-2, -1) if weight else tuple(range(xf.dim()))
        return xf.abs().amax(dim=dims, keepdim=True).expand(xf.shape) if xf.numel() else torch.zeros(xf.shape)
    if scheme == "fp8_token":
        return xf.abs().amax(dim=-1, keepdim=True).expand(xf.shape)
    return _tile_amax(xf, 128 if weight else 1, 128)


def _q(numerator, denominator) -> torch.Tensor:
    """The correctly rounded fp32 quotient: computed in fp64 and rounded once more, which is exact
    for division (53 >= 2 * 24 + 2 bits), unlike torch's ``2688 / t`` (``t.reciprocal() * 2688``)."""
    num = numerator.double() if isinstance(numerator, torch.Tensor) else numerator
    den = denominator.double() if isinstance(denominator, torch.Tensor) else denominator
    return (num / den).float()


def _spec_fp8_scale(amax: torch.Tensor) -> torch.Tensor:
    return _q(torch.clamp(amax.float(), min=AMAX_FLOOR), 448.0)


def _check_fp8_bound(x: torch.Tensor, xq: torch.Tensor, scale: torch.Tensor) -> None:
    # e4m3 keeps 3 mantissa bits: round-to-nearest errs by at most 2^-4 of the scaled value in
    # the normal range and by half the subnormal step 2^-9 below 2^-6; fp32 adds ~2^-23.
    x, xq = x.float().cpu(), xq.float().cpu()
    bound = torch.maximum(x.abs() * 2.0 ** -4, scale * 2.0 ** -10) * (1 + 2.0 ** -20) + x.abs() * 2.0 ** -20
    assert torch.all((x - xq).abs() <= bound), float(((x - xq).abs() - bound).max())


def _check_nvfp4_bound(x: torch.Tensor, xq: torch.Tensor, amax: torch.Tensor) -> None:
    # See the package docstring: |x - x'| <= 1/4 * max(|x|, 17/16 * block_amax / 6) while the
    # block scale (block_amax / 6) * g = 448 * block_amax / amax is an e4m3 normal (>= 2^-6) and
    # not clamped at 448; a block below that loses precision (subnormal scale) by design.
    x, xq = x.float().cpu(), xq.float().cpu()
    b = x.reshape(*x.shape[:-1], -1, 16).abs().amax(-1, keepdim=True).expand(*x.shape[:-1], -1, 16).reshape(x.shape)
    s_true = 448 * b / amax.cpu()
    assert torch.all((s_true >= 2.0 ** -6) & (s_true <= 448 * (1 + 2.0 ** -10))), "test input outside the bound's precondition"
    bound = 0.25 * torch.maximum(x.abs(), (17 / 16) * b / 6) * (1 + 2.0 ** -18)
    assert torch.all((x - xq).abs() <= bound), float(((x - xq).abs() - bound).max())
    # The coarser statement: never more than 17/96 (~0.177) of the block amax.
    assert torch.all((x - xq).abs() <= (17 / 96) * b * (1 + 2.0 ** -18) + 1e-30)


def _bytes_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(to_wire(a).cpu(), to_wire(b).cpu())


# ---------------------------------------------------------------------------- known values

def test_schemes_are_config_schemes_without_none():
    assert SCHEMES == tuple(s for s in BUILTIN_SCHEMES if s != "none")


def test_e2m1_encode_known_values_ties_to_even():
    x = torch.tensor([0, 0.25, 0.75, 1.25, 2.5, 5, 6, -6, 7])
    assert e2m1_encode(x).tolist() == [0, 0, 2, 2, 4, 6, 7, 15, 7]
    # The other ties go up to an even code; just off a tie rounds to the nearer value;
    # negative inputs keep the sign bit even when they round to zero; infinity saturates.
    y = torch.tensor([1.75, 3.5, 0.2501, 4.99, -0.1, -0.0, float("inf"), -1e9])
    assert e2m1_encode(y).tolist() == [4, 6, 1, 6, 8, 8, 7, 15]


def test_e2m1_decode_every_code():
    codes = torch.arange(16, dtype=torch.uint8)
    values = e2m1_decode(codes)
    assert values.dtype == torch.float32
    assert values[:8].tolist() == list(E2M1_VALUES) == [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    assert values[8:].tolist() == [-v for v in E2M1_VALUES]
    assert torch.signbit(values[8])  # code 0x8 is negative zero
    assert torch.equal(e2m1_encode(values), codes)


def test_pack_fp4_known_bytes():
    codes = e2m1_encode(torch.tensor([0.5, 1.0, -2.0, 6.0]))
    assert codes.tolist() == [0x1, 0x2, 0xC, 0x7]
    packed = pack_fp4(codes)
    # element 2i in the low nibble, 2i+1 in the high nibble
    assert packed.dtype == torch.uint8 and packed.tolist() == [0x21, 0x7C]
    assert torch.equal(unpack_fp4(packed), codes)
    with pytest.raises(ValueError, match="K=3"):
        pack_fp4(codes[:3])


def test_fp8_known_scale_and_codes():
    # amax 3.5 gives scale 3.5 / 448 = 2^-7 exactly; the scaled values 448, -128, 32, 0 are e4m3.
    x = torch.tensor([[3.5, -1.0], [0.25, 0.0]])
    q = quantize_activations(x, "fp8_tensor")
    assert q.tensor_scale.shape == () and q.tensor_scale.item() == 2.0 ** -7
    assert q.data.float().tolist() == [[448.0, -128.0], [32.0, 0.0]]
    assert torch.equal(q.dequantize(), x)
    # per expert for weights: expert 0 amax 3.5, expert 1 amax 448 -> scale 1
    w = torch.stack([x, torch.tensor([[448.0, 1.5], [-2.0, 0.0]])])
    qw = quantize_weight(w, "fp8_tensor")
    assert qw.scale.tolist() == [2.0 ** -7, 1.0]
    assert torch.equal(qw.dequantize(), w)
    # per token: rows have amax 3.5 and 0.25 -> 2^-7 and 0.25 / 448
    qt = quantize_activations(x, "fp8_token")
    assert qt.row_scale.tolist() == [[2.0 ** -7], [torch.tensor(0.25 / 448, dtype=torch.float32).item()]]


def test_nvfp4_known_scales_and_bytes():
    # One row, two blocks. amax 6 -> g = 2688 / 6 = 448. Block 0 amax 6 -> s = 448;
    # block 1 amax 3 -> s = 224 (e4m3: 1.75 * 2^7). Then x * g / s is x resp. 2x, all e2m1.
    block0 = [6.0, -0.5, 1.0, 0.0] + [0.0] * 12
    block1 = [3.0, 0.25, -0.75, 1.5] + [0.0] * 12
    x = torch.tensor([block0 + block1])
    q = quantize_activations(x, "nvfp4")
    assert q.tensor_scale.item() == 448.0
    assert q.row_scale.dtype == FP8_DTYPE and q.row_scale.float().tolist() == [[448.0, 224.0]]
    # codes: 6 -> 7, -0.5 -> 9, 1 -> 2, 0 -> 0; block 1 doubled: 6 -> 7, 0.5 -> 1, -1.5 -> 11, 3 -> 5
    assert q.data[0, :2].tolist() == [0x97, 0x02]
    assert q.data[0, 8:10].tolist() == [0x17, 0x5B]
    assert torch.equal(q.dequantize(), x)


def test_nvfp4_rounds_to_nearest_even_inside_the_scale():
    # amax 6 -> g = 448, block amax 6 -> s = 448, so x * g / s = x and rounding is e2m1's own.
    x = torch.tensor([[6.0, 2.5, 5.0, 0.75, 1.25, 3.5, 0.2] + [0.0] * 9])
    assert quantize_activations(x, "nvfp4").dequantize()[0, :7].tolist() == [6.0, 2.0, 4.0, 1.0, 1.0, 4.0, 0.0]


# ---------------------------------------------------------------------------- round trips

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("scheme", ["fp8_tensor", "fp8_token", "fp8_block"])
def test_fp8_round_trip_bound(scheme, dtype, device):
    w = _rand(3, 200, 300, dtype=dtype, device=device, seed=1)
    qw = quantize_weight(w, scheme)
    assert qw.data.device.type == device and qw.shape == (3, 200, 300)
    expected = _spec_fp8_scale(_fp8_group_amax(w, scheme, weight=True))
    _check_fp8_bound(w, qw.dequantize(), expected)
    assert qw.dequantize(dtype).dtype == dtype

    x = _rand(7, 300, dtype=dtype, device=device, seed=2)
    qx = quantize_activations(x, scheme)
    scale = _spec_fp8_scale(_fp8_group_amax(x, scheme, weight=False))
    stored = {"fp8_tensor": qx.tensor_scale, "fp8_token": qx.row_scale, "fp8_block": qx.row_scale}[scheme].cpu()
    if scheme == "fp8_block":
        assert stored.shape == (7, 3) and torch.equal(stored, scale[:, ::128])
    else:
        assert torch.equal(stored.expand(7, 300), scale)
    _check_fp8_bound(x, qx.dequantize(), scale)
    # The coarser per-group statement from the brief: error <= 2^-4 * group amax.
    err = (qx.dequantize().cpu() - x.float().cpu()).abs()
    assert torch.all(err <= 2.0 ** -4 * _fp8_group_amax(x, scheme, weight=False))


def test_fp8_weight_scales_follow_the_convention():
    w = _rand(2, 130, 260, seed=3)
    assert torch.equal(quantize_weight(w, "fp8_tensor").scale, _spec_fp8_scale(w.abs().amax(dim=(1, 2))))
    assert torch.equal(quantize_weight(w, "fp8_token").scale, _spec_fp8_scale(w.abs().amax(dim=2)))
    blocks = quantize_weight(w, "fp8_block").scale
    assert blocks.shape == (2, 2, 3)
    assert torch.equal(blocks, _spec_fp8_scale(_tile_amax(w, 128, 128))[:, ::128, ::128])
    assert blocks[1, 1, 2].item() == _spec_fp8_scale(w[1, 128:, 256:].abs().max()).item()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_nvfp4_round_trip_bound(dtype, device):
    w = _rand(3, 40, 160, dtype=dtype, device=device, seed=4, spread=0.5)
    qw = quantize_weight(w, "nvfp4")
    assert qw.data.shape == (3, 40, 80) and qw.scale.shape == (3, 40, 10) and qw.global_scale.shape == (3,)
    wf = w.float().cpu()
    assert torch.equal(qw.global_scale.cpu(), _q(2688.0, wf.abs().amax(dim=(1, 2))))
    _check_nvfp4_bound(w, qw.dequantize(), wf.abs().amax(dim=(1, 2), keepdim=True))

    x = _rand(9, 160, dtype=dtype, device=device, seed=5, spread=0.5)
    qx = quantize_activations(x, "nvfp4")
    xf = x.float().cpu()
    g = _q(2688.0, xf.abs().max())
    assert torch.equal(qx.tensor_scale.cpu(), g)
    s = (_q(xf.reshape(9, 10, 16).abs().amax(-1), 6) * g).clamp(max=448).to(FP8_DTYPE)
    assert _bytes_equal(qx.row_scale, s)
    _check_nvfp4_bound(x, qx.dequantize(), xf.abs().max())


def _fp8_exact_values(*shape: int, seed: int) -> torch.Tensor:
    """e4m3-representable values with 448 in columns 0, 128, 256, ... of every row, so every fp8
    group (tensor, row, 128x128 tile, 1x128 group) has amax 448 and scale 1."""
    gen = torch.Generator().manual_seed(seed)
    bits = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
    bits[(bits & 0x7F) == 0x7F] = 0  # drop NaN codes
    v = bits.view(FP8_DTYPE).float()
    v[..., ::128] = 448.0
    return v


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scheme", ["fp8_tensor", "fp8_token", "fp8_block"])
def test_fp8_representable_inputs_round_trip_exactly(scheme, device):
    # Scaling by powers of two keeps every scale (448 * 2^k / 448) and every quotient exact.
    w = _fp8_exact_values(3, 150, 260, seed=6) * torch.tensor([1.0, 2.0 ** -5, 2.0 ** 3])[:, None, None]
    w = w.to(device)
    assert torch.equal(quantize_weight(w, scheme).dequantize(), w)
    x = _fp8_exact_values(5, 260, seed=7) * 2.0 ** -9
    x = x.to(device)
    assert torch.equal(quantize_activations(x, scheme).dequantize(), x)


def _nvfp4_exact_values(*shape: int, seed: int) -> torch.Tensor:
    """e2m1 values times 2^j per 16-block (j in -3..0), each block holding 6 * 2^j, and the first
    block of every row having j = 0, so every row, expert and tensor has amax exactly 6."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, shape, generator=gen, dtype=torch.uint8)
    v = e2m1_decode(codes).reshape(*shape[:-1], shape[-1] // 16, 16)
    v[..., 0] = 6.0
    j = torch.randint(-3, 1, v.shape[:-1], generator=gen).float()
    j[..., 0] = 0.0
    return (v * torch.exp2(j)[..., None]).reshape(shape)


@pytest.mark.parametrize("device", DEVICES)
def test_nvfp4_representable_inputs_round_trip_exactly(device):
    # amax 6 * 2^k -> g = 448 * 2^-k; block amax 6 * 2^(j+k) -> s = 448 * 2^j, e4m3-exact.
    w = _nvfp4_exact_values(2, 8, 64, seed=8) * torch.tensor([1.0, 2.0 ** 4])[:, None, None]
    w = w.to(device)
    assert torch.equal(quantize_weight(w, "nvfp4").dequantize(), w)
    x = (_nvfp4_exact_values(6, 64, seed=9) * 2.0 ** -3).to(device)
    assert torch.equal(quantize_activations(x, "nvfp4").dequantize(), x)


@pytest.mark.skipif(not CUDA, reason="CUDA is not available")
@pytest.mark.parametrize("scheme", SCHEMES)
def test_cuda_matches_cpu_bit_for_bit_without_host_syncs(scheme):
    w = _rand(2, 130, 160, seed=10)
    x = _rand(5, 160, seed=11)
    ids = torch.tensor([1, 0], device="cuda")
    wc, xc, amax = w.cuda(), x.cuda(), x.abs().amax(dim=1, keepdim=True).cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        qw = quantize_weight(wc, scheme)
        qx = quantize_activations(xc, scheme)
        qa = quantize_activations(xc, scheme, amax=amax)
        outs = (qw.dequantize(), qx.dequantize(), qa.index_rows(ids).dequantize(), qw.select_experts(ids).dequantize())
    finally:
        torch.cuda.set_sync_debug_mode(0)
    ref_w, ref_x = quantize_weight(w, scheme), quantize_activations(x, scheme)
    assert _bytes_equal(qw.data, ref_w.data) and _bytes_equal(qw.scale, ref_w.scale)
    assert _bytes_equal(qx.data, ref_x.data)
    assert torch.equal(outs[0].cpu(), ref_w.dequantize()) and torch.equal(outs[1].cpu(), ref_x.dequantize())
    assert torch.equal(outs[2].cpu(), quantize_activations(x, scheme, amax=amax.cpu()).dequantize()[[1, 0]])


# ---------------------------------------------------------------------------- swizzle

@pytest.mark.parametrize("shape", [(0, 5), (1, 1), (1, 7), (127, 4), (130, 5), (256, 8), (3, 129, 3), (2, 0, 4)])
def test_swizzle_unswizzle_inverse(shape):
    gen = torch.Generator().manual_seed(12)
    s = torch.randint(0, 0x7F, shape, generator=gen, dtype=torch.uint8).view(FP8_DTYPE)
    rows, cols = shape[-2:]
    sw = swizzle_scales(s)
    assert sw.dtype == FP8_DTYPE and tuple(sw.shape) == (*shape[:-2], *swizzled_shape(rows, cols))
    assert tuple(sw.shape[-2:]) == (-(-rows // 128) * 128, -(-cols // 4) * 4)
    back = unswizzle_scales(sw, rows, cols)
    assert _bytes_equal(back, s)
    # padding is zero: the swizzled matrix holds exactly the original bytes plus zeros
    assert to_wire(sw).long().sum() == to_wire(s).long().sum()


def test_swizzle_hand_checked_positions():
    # M=130, C=7 -> [256, 8]. (m, c) = (128a + 32b + r, 4d + e) lands at flat
    # ((a * 2 + d) * 32 + r) * 16 + 4b + e:
    #   (37, 6):  a=0 b=1 r=5,  d=1 e=2 -> (1*32 + 5)*16 + 4 + 2 = 598  -> row 74,  col 6
    #   (129, 2): a=1 b=0 r=1,  d=0 e=2 -> (2*32 + 1)*16 + 0 + 2 = 1042 -> row 130, col 2
    #   (100, 3): a=0 b=3 r=4,  d=0 e=3 -> (0 + 4)*16 + 12 + 3   = 79   -> row 9,   col 7
    s = torch.arange(130 * 7, dtype=torch.float32).reshape(130, 7) + 1
    sw = swizzle_scales(s)
    assert sw.shape == (256, 8)
    assert sw[74, 6] == s[37, 6] and sw.flatten()[598] == s[37, 6]
    assert sw[130, 2] == s[129, 2]
    assert sw[9, 7] == s[100, 3]
    assert torch.equal(unswizzle_scales(sw, 130, 7), s)


def test_unswizzle_refuses_wrong_shape():
    with pytest.raises(ValueError, match=r"rows=130, cols=7.*\(256, 8\)"):
        unswizzle_scales(torch.zeros(128, 8), 130, 7)


# ---------------------------------------------------------------------------- wire

def test_wire_views_are_bit_exact():
    bits = torch.arange(256, dtype=torch.uint8).reshape(16, 16)
    f8 = bits.view(FP8_DTYPE)  # includes both NaN codes
    wire = to_wire(f8)
    assert wire.dtype == torch.uint8 and torch.equal(wire, bits)
    assert wire.data_ptr() == f8.data_ptr()  # a view, no copy
    assert _bytes_equal(from_wire(wire, FP8_DTYPE), f8)
    for t in (torch.tensor([-1, 5], dtype=torch.int8), torch.tensor([True, False])):
        assert to_wire(t).dtype == torch.uint8 and torch.equal(from_wire(to_wire(t), t.dtype), t)
    for t in (bits, torch.randn(3), torch.randn(3).bfloat16()):
        assert to_wire(t) is t and from_wire(t, t.dtype) is t
    with pytest.raises(ValueError, match="float32.*bfloat16"):
        from_wire(torch.randn(3), torch.bfloat16)


# ---------------------------------------------------------------------------- select / slice / cat

# (scheme, row slices, col slices, N split for cat_out) on a [4, 300, 288] weight
SLICES = [
    ("fp8_tensor", [(7, 150), (0, 300), (299, 300)], [(5, 77), (0, 288)], 150),
    ("fp8_token", [(7, 150), (0, 0)], [(5, 77), (287, 288)], 150),
    ("fp8_block", [(128, 300), (0, 128), (128, 256), (256, 300)], [(128, 288), (0, 256), (256, 288)], 256),
    ("nvfp4", [(7, 150), (1, 2)], [(16, 48), (0, 288), (272, 288)], 151),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scheme,rows,cols,split", SLICES)
def test_select_slice_cat_match_the_dequantized_weight(scheme, rows, cols, split, device):
    full = quantize_weight(_rand(4, 300, 288, seed=13, device=device), scheme)
    dense = full.dequantize()
    ids = torch.tensor([2, 0, 3], device=device)
    assert torch.equal(full.select_experts(ids).dequantize(), dense[[2, 0, 3]])
    assert full.select_experts(ids).shape == (3, 300, 288)
    assert full.select_experts(ids[:0]).dequantize().shape == (0, 300, 288)
    for a, b in rows:
        part = full.slice_out(a, b)
        assert part.shape == (4, b - a, 288) and torch.equal(part.dequantize(), dense[:, a:b])
        # the shard owns its storage: the full weight can be freed
        assert part.data.untyped_storage().nbytes() == part.data.numel() * part.data.element_size()
    for a, b in cols:
        part = full.slice_in(a, b)
        assert part.shape == (4, 300, b - a) and torch.equal(part.dequantize(), dense[..., a:b])
    # slicing composes: rows then columns, as a TP rank does
    a, b = rows[0]
    c, d = cols[0]
    assert torch.equal(full.slice_out(a, b).slice_in(c, d).dequantize(), dense[:, a:b, c:d])
    fused = QuantizedWeight.cat_out([full.slice_out(0, split), full.slice_out(split, 300)])
    assert fused.shape == full.shape and _bytes_equal(fused.data, full.data)
    assert torch.equal(fused.dequantize(), dense)
    # gate/up style: re-fuse two TP shards taken from different halves
    halves = QuantizedWeight.cat_out([full.slice_out(0, 128), full.slice_out(256, 300)])
    assert torch.equal(halves.dequantize(), torch.cat([dense[:, :128], dense[:, 256:]], dim=1))
    moved = full.to("cpu")
    assert torch.equal(moved.dequantize(), dense.cpu())


def test_slicing_refuses_misaligned_boundaries():
    block = quantize_weight(_rand(2, 300, 288, seed=14), "fp8_block")
    with pytest.raises(ValueError, match=r"\[100, 300\) of N must be multiples of 128"):
        block.slice_out(100, 300)
    with pytest.raises(ValueError, match=r"\[0, 200\) of K must be multiples of 128 \(or the end of K, 288\)"):
        block.slice_in(0, 200)
    fp4 = quantize_weight(_rand(2, 30, 64, seed=15), "nvfp4")
    with pytest.raises(ValueError, match=r"\[8, 32\) of K must be multiples of 16"):
        fp4.slice_in(8, 32)
    with pytest.raises(ValueError, match=r"\[0, 31\) is not a range of N=30"):
        fp4.slice_out(0, 31)
    with pytest.raises(ValueError, match="start must be an int"):
        fp4.slice_in(1.5, 16)


def test_cat_out_refusals():
    w = _rand(2, 40, 64, seed=16)
    a, b = w[:, :20], w[:, 20:]
    with pytest.raises(ValueError, match=r"parts\[1\]\.scale differs"):
        QuantizedWeight.cat_out([quantize_weight(a, "fp8_tensor"), quantize_weight(b * 3, "fp8_tensor")])
    with pytest.raises(ValueError, match=r"parts\[1\]\.global_scale differs"):
        QuantizedWeight.cat_out([quantize_weight(a, "nvfp4"), quantize_weight(b * 3, "nvfp4")])
    with pytest.raises(ValueError, match=r"fp8_block parts\[0\] has N=20"):
        QuantizedWeight.cat_out([quantize_weight(a, "fp8_block"), quantize_weight(b, "fp8_block")])
    with pytest.raises(ValueError, match="scheme, E and K must match"):
        QuantizedWeight.cat_out([quantize_weight(a, "fp8_token"), quantize_weight(b, "fp8_block")])
    with pytest.raises(ValueError, match="parts is empty"):
        QuantizedWeight.cat_out([])
    # separately quantized per-row schemes need no shared scale
    fused = QuantizedWeight.cat_out([quantize_weight(a, "fp8_token"), quantize_weight(b, "fp8_token")])
    assert torch.equal(fused.dequantize(), quantize_weight(w, "fp8_token").dequantize())


# ---------------------------------------------------------------------------- activations

@pytest.mark.parametrize("scheme", SCHEMES)
def test_index_rows_and_fake_quantize(scheme):
    x = _rand(6, 256, seed=17)
    amax = x.abs().amax(dim=1, keepdim=True) * 1.5
    for q in (quantize_activations(x, scheme), quantize_activations(x, scheme, amax=amax)):
        idx = torch.tensor([4, 0, 4, 5])
        picked = q.index_rows(idx)
        assert picked.shape == (4, 256) and torch.equal(picked.dequantize(), q.dequantize()[idx])
        assert q.index_rows(idx[:0]).dequantize().shape == (0, 256)
    fake = fake_quantize_activations(x.bfloat16(), scheme)
    assert fake.dtype == torch.float32
    assert torch.equal(fake, quantize_activations(x.bfloat16(), scheme).dequantize())
    with pytest.raises(ValueError, match="1-D int64"):
        quantize_activations(x, scheme).index_rows(torch.tensor([True, False]))


@pytest.mark.parametrize("scheme", SCHEMES)
def test_amax_override_makes_row_subsets_quantize_identically(scheme):
    # What the layer relies on: rows quantized on any rank with the all-reduced (or per-row
    # group) amax are bit-identical to the same rows quantized together.
    x = _rand(8, 160, seed=18)
    idx = torch.tensor([6, 1, 3])
    glob = x.abs().max()
    full, part = quantize_activations(x, scheme, amax=glob), quantize_activations(x[idx], scheme, amax=glob)
    assert _bytes_equal(full.index_rows(idx).data, part.data)
    assert torch.equal(full.index_rows(idx).dequantize(), part.dequantize())
    group = torch.where(torch.arange(8)[:, None] < 4, x[:4].abs().max(), x[4:].abs().max())  # [8, 1]
    full, part = quantize_activations(x, scheme, amax=group), quantize_activations(x[idx], scheme, amax=group[idx])
    assert torch.equal(full.index_rows(idx).dequantize(), part.dequantize())


def test_amax_override_sets_the_per_tensor_scales():
    x = _rand(4, 32, seed=19, spread=0.5)
    a = x.abs().max() * 2
    q = quantize_activations(x, "fp8_tensor", amax=a)
    assert q.tensor_scale.shape == () and q.tensor_scale.item() == _q(a, 448).item()
    _check_fp8_bound(x, q.dequantize(), torch.full(x.shape, _q(a, 448).item()))
    q = quantize_activations(x, "nvfp4", amax=a)
    assert q.tensor_scale.item() == _q(2688.0, a).item()
    _check_nvfp4_bound(x, q.dequantize(), a)
    rows = x.abs().amax(dim=1, keepdim=True)
    q = quantize_activations(x, "fp8_tensor", amax=rows)
    assert q.tensor_scale.shape == (4, 1) and torch.equal(q.tensor_scale, _q(rows, 448))
    # with a per-row amax, fp8_tensor equals per-token quantization
    assert torch.equal(q.dequantize(), quantize_activations(x, "fp8_token").dequantize())
    q = quantize_activations(x, "nvfp4", amax=rows)
    assert q.tensor_scale.shape == (4, 1) and torch.equal(q.tensor_scale, _q(2688.0, rows))
    # per-row and per-group schemes ignore the override
    for scheme in ("fp8_token", "fp8_block"):
        assert torch.equal(quantize_activations(x, scheme, amax=a).dequantize(),
                           quantize_activations(x, scheme).dequantize())
    with pytest.raises(ValueError, match=r"amax must be a float tensor of shape \[\] or \[M, 1\] = \[4, 1\], "
                                         r"got torch.float32 \[4\]"):
        quantize_activations(x, "fp8_tensor", amax=rows[:, 0])


@pytest.mark.parametrize("scheme", SCHEMES)
def test_zero_rows(scheme):
    q = quantize_activations(torch.zeros(0, 256, dtype=torch.bfloat16), scheme)
    assert q.shape == (0, 256) and q.dequantize().shape == (0, 256)
    if scheme in ("fp8_tensor", "nvfp4"):
        assert q.tensor_scale.shape == () and torch.isfinite(q.tensor_scale)
    else:
        assert q.row_scale.shape[0] == 0
    q = quantize_activations(torch.zeros(0, 256), scheme, amax=torch.zeros(0, 1))
    assert q.dequantize().shape == (0, 256)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_all_zero_inputs_give_zeros_not_nan(scheme):
    for x in (torch.zeros(3, 128), torch.cat([torch.zeros(1, 128), _rand(2, 128, seed=20)])):
        q = quantize_activations(x, scheme)
        out = q.dequantize()
        assert torch.isfinite(out).all() and torch.equal(out[0], torch.zeros(128))
    q = quantize_activations(torch.zeros(2, 128), scheme, amax=torch.zeros(()))
    assert torch.equal(q.dequantize(), torch.zeros(2, 128))
    if scheme == "fp8_tensor":
        assert q.tensor_scale.item() == torch.tensor(AMAX_FLOOR / 448, dtype=torch.float32).item()
    qw = quantize_weight(torch.zeros(2, 16, 32), scheme)
    assert torch.equal(qw.dequantize(), torch.zeros(2, 16, 32))
    for t in (qw.scale.float(), qw.global_scale if qw.global_scale is not None else torch.zeros(1)):
        assert torch.isfinite(t).all()


def test_tiny_blocks_next_to_large_ones_do_not_produce_nan():
    # A block 1e-9 below the tensor amax gets an e4m3 block scale that rounds to 0.
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 16] = 1.0, 1e-9
    q = quantize_activations(x, "nvfp4")
    assert q.row_scale.float()[0, 1] == 0
    out = q.dequantize()
    assert torch.isfinite(out).all() and out[0, 0] == 1.0 and out[0, 16] == 0


# ---------------------------------------------------------------------------- refusals

def test_unknown_schemes_and_bad_shapes_are_refused():
    x = torch.randn(2, 32)
    for bad in ("int4", "none"):
        with pytest.raises(ValueError, match=rf"scheme {bad!r} is not a quantized scheme"):
            quantize_activations(x, bad)
        with pytest.raises(ValueError, match=rf"scheme {bad!r}"):
            quantize_weight(torch.randn(1, 2, 32), bad)
    with pytest.raises(ValueError, match=r"nvfp4 needs K % 16 == 0, got x.shape\[1\] \(K\)=24"):
        quantize_activations(torch.randn(2, 24), "nvfp4")
    with pytest.raises(ValueError, match=r"nvfp4 needs K % 16 == 0, got w.shape\[2\] \(K\)=24"):
        quantize_weight(torch.randn(1, 2, 24), "nvfp4")
    with pytest.raises(ValueError, match=r"x must be a float \[M, K\] tensor, got torch.float32 \[2, 2, 8\]"):
        quantize_activations(torch.randn(2, 2, 8), "fp8_token")
    with pytest.raises(ValueError, match=r"w must be a float \[E, N, K\] tensor, got torch.int64 \[1, 2, 16\]"):
        quantize_weight(torch.ones(1, 2, 16, dtype=torch.long), "fp8_token")
    q = quantize_weight(torch.randn(2, 4, 32), "fp8_token")
    with pytest.raises(ValueError, match=r"QuantizedWeight.scale \(fp8_token\): expected torch.float32 \[2, 4\], "
                                         r"got torch.float32 \[2\]"):
        QuantizedWeight("fp8_token", q.data, q.scale[:, 0], None, (2, 4, 32))
    with pytest.raises(ValueError, match=r"tensor_scale: expected float32 \[\] or \[3, 1\]"):
        QuantizedActivations("fp8_tensor", torch.zeros(3, 8, dtype=FP8_DTYPE), None, torch.ones(3))
    with pytest.raises(ValueError, match="dtype must be a floating-point"):
        q.dequantize(torch.int32)
    assert math.isclose(q.dequantize(torch.float16).float().abs().max().item(),
                        q.dequantize().abs().max().item(), rel_tol=1e-3)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_activations_survive_the_wire(scheme):
    # Dispatch sends every field as a uint8 (or fp32) view and rebuilds the container.
    q = quantize_activations(_rand(5, 160, seed=21), scheme, amax=torch.tensor(40.0))
    fields = (q.data, q.row_scale, q.tensor_scale)
    sent = [None if t is None else to_wire(t).clone() for t in fields]
    assert all(t is None or t.dtype in (torch.uint8, torch.float32) for t in sent)
    back = QuantizedActivations(scheme, *[None if t is None else from_wire(t, f.dtype)
                                          for t, f in zip(sent, fields, strict=True)])
    assert torch.equal(back.dequantize(), q.dequantize())


@pytest.mark.parametrize("scheme", ["fp8_tensor", "fp8_token", "fp8_block", "nvfp4"])
def test_scales_from_another_tensor(scheme):
    """scales_from=x is the default; with the scales of 2x every scale doubles exactly (and the
    nvfp4 global scale halves), so x lands on the grid of x / 2 quantized with x's scales, doubled;
    the scales of 1.5x put x on another grid."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, 160 if scheme != "nvfp4" else 64, generator=g)
    base = fake_quantize_activations(x, scheme)
    assert torch.equal(fake_quantize_activations(x, scheme, scales_from=x), base)
    coarse = fake_quantize_activations(x, scheme, scales_from=2 * x)
    assert torch.equal(coarse, 2 * fake_quantize_activations(x / 2, scheme, scales_from=x))
    # Scales of 1.5 x move the grid itself: values round differently.
    assert not torch.equal(fake_quantize_activations(x, scheme, scales_from=1.5 * x), base)
    with pytest.raises(ValueError, match=r"scales_from must have x's shape \[6, "):
        quantize_activations(x, scheme, scales_from=x[:3])
