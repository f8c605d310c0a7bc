"""nvfp4 operands decoded once, before the grouped GEMM, instead of in every program that reads them.

    codes uint8 [R, K / 2] + e4m3 block scales [R, K / 16] --one pass--> fp16 values [R, K]
        value = e2m1(code) * block scale (exact in fp16); the fp32 global scales stay beside

The grouped GEMM's nvfp4 mode (``grouped_gemm``) decodes its operand tiles in registers. At
prefill that work is repeated: each A tile is decoded again by the program of every column
block, each weight tile again for every row tile, and the unpacking runs on the CUDA cores at
about ten integer and fp16 operations per value, more than the tensor cores need for the
product. Decoding an operand once, here, leaves the GEMM an fp16 operand (``Nvfp4Values``);
it computes the same products (the decoded values are the same fp16 numbers either way) and
divides by the global scales in its epilogue as it does for codes. Decoding the weights costs a
transient fp16 copy of them, four times the codes' bytes (``configs.select_config`` says where
each is chosen).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moeshard.quant import NVFP4_BLOCK, QuantizedActivations, QuantizedWeight

ROWS = 16  # rows per program
COLS = 256  # decoded columns per program (a multiple of NVFP4_BLOCK)


@triton.jit
def e2m1_scaled_f16(packed, scale, ROWS: tl.constexpr, COLS: tl.constexpr):
    """packed uint8 [ROWS, COLS // 2] e2m1 codes (value 2i in the low nibble), scale e4m3
    [ROWS, COLS // 16] -> fp16 [ROWS, COLS] = e2m1 value * block scale.

    e2m1 (s, e1 e0, m) placed in the fp16 bit pattern as (s, 000 e1 e0, m 000000000) is the value
    times 2^-14 for every code, the subnormal 0.5 included; multiplying by 2^14 in fp16 is exact.
    e2m1 value * e4m3 scale has at most 6 significant bits and lies in [2^-10, 2688], so the
    fp16 product is exact too: no fp32 round trip is needed.
    """
    lo = packed & 0xF
    hi = packed >> 4
    code = tl.reshape(tl.join(lo, hi), (ROWS, COLS)).to(tl.uint16)
    bits = ((code & 0x7) << 9) | ((code & 0x8) << 12)
    value = bits.to(tl.float16, bitcast=True) * 16384.0
    s = scale.to(tl.float16)
    s = tl.reshape(tl.broadcast_to(s[:, :, None], (ROWS, COLS // 16, 16)), (ROWS, COLS))
    return value * s


@triton.jit
def _decode_kernel(q_ptr, s_ptr, out_ptr, R, K, stride_q, stride_s, stride_out,
                   ROWS: tl.constexpr, COLS: tl.constexpr):
    """out[r, c] = e2m1(q[r, c]) * s[r, c // 16] for one ROWS x COLS block of values."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    c0 = tl.program_id(1) * COLS
    pcols = c0 // 2 + tl.arange(0, COLS // 2)
    scols = c0 // 16 + tl.arange(0, COLS // 16)
    cols = c0 + tl.arange(0, COLS)
    row_ok = rows < R
    rows64 = rows.to(tl.int64)
    packed = tl.load(q_ptr + rows64[:, None] * stride_q + pcols[None, :],
                     mask=row_ok[:, None] & (pcols < K // 2)[None, :], other=0)
    scale = tl.load(s_ptr + rows64[:, None] * stride_s + scols[None, :],
                    mask=row_ok[:, None] & (scols < K // 16)[None, :], other=0.0)
    values = e2m1_scaled_f16(packed, scale, ROWS, COLS)
    tl.store(out_ptr + rows64[:, None] * stride_out + cols[None, :], values,
             mask=row_ok[:, None] & (cols < K)[None, :])


@dataclass(frozen=True)
class Nvfp4Values:
    """An nvfp4 operand of the grouped GEMM, decoded.

    values: fp16 [M, K] (activations) or [E, N, K] (weights): e2m1 value * e4m3 block scale, so
        ``values / global_scale`` is the dequantized tensor.
    global_scale: fp32, as the quantized tensor held it: activations [] or [M, 1], weights [E].
    """

    values: torch.Tensor
    global_scale: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.values.shape


def _decode(q: torch.Tensor, s: torch.Tensor, k: int) -> torch.Tensor:
    """q uint8 [R, k / 2], s e4m3 [R, k / 16] (unit column strides) -> fp16 [R, k]."""
    q, s = (u if u.stride(1) == 1 else u.contiguous() for u in (q, s))
    r = q.shape[0]
    out = torch.empty(r, k, dtype=torch.float16, device=q.device)
    if r and k:
        grid = (triton.cdiv(r, ROWS), triton.cdiv(k, COLS))
        # e4m3 scales load as their bytes' float8 type; uint8 codes as bytes.
        _decode_kernel[grid](q, s, out, r, k, q.stride(0), s.stride(0), out.stride(0), ROWS=ROWS, COLS=COLS)
    return out


def nvfp4_values(t: QuantizedActivations | QuantizedWeight, experts: tuple[int, int] | None = None) -> Nvfp4Values:
    """Decodes nvfp4 activations ([M, K]) or expert weights ([E, N, K]) to fp16 values (one launch).

    experts: (lo, hi), weights only: decode experts [lo, hi) alone, to [hi - lo, N, K] values
    with their global scales (``moe_gemm``'s expert window takes them), so that a large
    projection is held decoded a window at a time. The result holds the same numbers the GEMM's
    nvfp4 mode decodes in registers; pass it to ``moe_gemm`` in place of ``t``."""
    if t.scheme != "nvfp4":
        raise ValueError(f"nvfp4_values: expected nvfp4 operands, got scheme {t.scheme!r}")
    if isinstance(t, QuantizedWeight):
        e, n, k = t.shape
        lo, hi = (0, e) if experts is None else experts
        if not (0 <= lo < hi <= e):
            raise ValueError(f"nvfp4_values: experts={experts!r} is not a window 0 <= lo < hi <= E={e}")
        assert t.global_scale is not None  # nvfp4 weights carry one (QuantizedWeight validates it)
        rows = (hi - lo) * n
        values = _decode(t.data[lo:hi].reshape(rows, k // 2), t.scale[lo:hi].reshape(rows, k // NVFP4_BLOCK), k)
        return Nvfp4Values(values.view(hi - lo, n, k), t.global_scale if experts is None else t.global_scale[lo:hi])
    if experts is not None:
        raise ValueError(f"nvfp4_values: experts={experts!r} selects experts of weights; activations have none")
    half = t.data.shape[1]
    assert t.row_scale is not None and t.tensor_scale is not None  # the nvfp4 codec has both
    return Nvfp4Values(_decode(t.data, t.row_scale, 2 * half), t.tensor_scale)
