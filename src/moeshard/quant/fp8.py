"""FP8 e4m3 helpers, amax reductions and the uint8 wire view.

Conventions (see the package docstring for the full table):

* ``scale = max(amax, AMAX_FLOOR) / FP8_MAX`` in fp32;
* ``q = clamp(x / scale, -FP8_MAX, FP8_MAX).to(float8_e4m3fn)``;
* ``x ~= q.float() * scale``.

Every function here is pure torch and never reads a value back to the host, so it runs
unchanged on CPU and CUDA (and under CUDA graph capture).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0

# An all-zero tensor, row or block has amax 0 and would give scale 0 (fp8: x / 0 = NaN) or an
# infinite nvfp4 global scale (2688 / 0). Every amax is raised to this floor before it becomes a
# divisor. 1e-12 keeps every derived quantity a normal fp32 number: the fp8 scale 1e-12/448 ~ 2e-15,
# its reciprocal ~ 4e14, the nvfp4 global scale 2688/1e-12 ~ 3e15. A nonzero amax below the floor
# is quantized as if it were 1e-12 (values keep an absolute error <= 1e-12 * 2^-10 / 448 at worst).
AMAX_FLOOR = 1e-12


def abs_amax(x: Tensor, dims: tuple[int, ...], keepdim: bool = False) -> Tensor:
    """``x.abs().amax(dims)`` in fp32 that also accepts empty reductions.

    Args:
        x: float tensor of any shape and float dtype.
        dims: the dimensions reduced.
    Returns:
        fp32 tensor of ``x``'s shape without (or, with ``keepdim``, with size 1 in) ``dims``;
        0 where the reduced dimensions hold no element (``torch.amax`` refuses those), which is
        what an empty row or an M = 0 batch should contribute to an amax.
    """
    dims = tuple(d % x.dim() for d in dims) if x.dim() else ()
    if math.prod(x.shape[d] for d in dims) == 0:
        shape = [1 if d in dims else n for d, n in enumerate(x.shape) if keepdim or d not in dims]
        return torch.zeros(shape, dtype=torch.float32, device=x.device)
    return x.float().abs().amax(dim=dims, keepdim=keepdim)


def block_amax(x: Tensor, block: tuple[int, int]) -> Tensor:
    """Amax of each ``block[0] x block[1]`` tile over the last two dimensions of ``x``.

    Args:
        x: float tensor ``[..., R, C]``.
        block: ``(br, bc)``, both positive. Edge tiles may be partial (the tensor is padded
            with zeros, which never raise an amax).
    Returns:
        fp32 ``[..., ceil(R / br), ceil(C / bc)]``.
    """
    br, bc = block
    rows, cols = x.shape[-2], x.shape[-1]
    rb, cb = -(-rows // br), -(-cols // bc)
    padded = torch.nn.functional.pad(x.float().abs(), (0, cb * bc - cols, 0, rb * br - rows))
    tiles = padded.reshape(*x.shape[:-2], rb, br, cb, bc)
    return tiles.amax(dim=(-3, -1))


def expand_blocks(s: Tensor, block: tuple[int, int], shape: tuple[int, int]) -> Tensor:
    """Inverse of the tiling in ``block_amax``: repeats each tile's value over its tile.

    Args:
        s: ``[..., ceil(R / br), ceil(C / bc)]``, any dtype.
        block: ``(br, bc)``.
        shape: ``(R, C)``, the unpadded size of the last two dimensions.
    Returns:
        ``[..., R, C]`` of ``s``'s dtype.
    """
    rows, cols = shape
    return s.repeat_interleave(block[0], dim=-2)[..., :rows, :].repeat_interleave(block[1], dim=-1)[..., :cols]


def const(value: float, like: Tensor) -> Tensor:
    """A 0-dim fp32 tensor holding ``value`` on ``like``'s device.

    Divide by this instead of a Python number: CUDA turns division by a host scalar into a
    multiplication by its rounded reciprocal, which can differ from the correctly rounded quotient
    in the last bit, so CPU and CUDA scales would disagree. Filling it launches a kernel, no sync.
    """
    return torch.full((), value, dtype=torch.float32, device=like.device)


def fp8_scale(amax: Tensor) -> Tensor:
    """fp32 scale ``max(amax, AMAX_FLOOR) / FP8_MAX`` (same shape as ``amax``), correctly rounded."""
    amax = amax.float().clamp_min(AMAX_FLOOR)
    return amax / const(FP8_MAX, amax)


def fp8_quantize(x: Tensor, scale: Tensor) -> Tensor:
    """Quantizes ``x`` (any float dtype) with ``scale`` (fp32, broadcastable to ``x``).

    Returns float8_e4m3fn of ``x``'s shape. The clamp makes saturation explicit: the cast
    itself saturates on some builds and produces NaN on others.
    """
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def fp8_float(q: Tensor) -> Tensor:
    """``q.float()`` for float8_e4m3fn ``q``, exactly. On CPU, where torch converts float8 one
    element at a time, as a gather from the 256 values of the format (a table made on the
    device, no host copy), about 4x faster."""
    if q.device.type != "cpu":
        return q.float()
    table = torch.arange(256, dtype=torch.int32, device=q.device).to(torch.uint8).view(FP8_DTYPE).float()
    return table.index_select(0, to_wire(q).reshape(-1).int()).view(q.shape)


def fp8_dequantize(q: Tensor, scale: Tensor) -> Tensor:
    """fp32 ``q.float() * scale`` (``scale`` broadcastable to ``q``)."""
    return fp8_float(q) * scale


def to_wire(t: Tensor) -> Tensor:
    """View of ``t`` that every collective backend can send.

    gloo (and some NCCL builds) refuse float8 tensors, so a tensor of any 1-byte dtype other
    than uint8 (float8_e4m3fn, int8, bool, ...) is returned as a uint8 view of the same bytes
    and shape; uint8 and wider dtypes are returned unchanged. No copy is made.
    """
    if t.dtype != torch.uint8 and t.element_size() == 1:
        return t.view(torch.uint8)
    return t


def from_wire(t: Tensor, dtype: torch.dtype) -> Tensor:
    """Inverse of ``to_wire``: a view of ``t`` as ``dtype``.

    Args:
        t: tensor received from the wire (uint8 for 1-byte payloads).
        dtype: the dtype the payload had before ``to_wire``.
    Raises:
        ValueError: when ``t`` is neither already of ``dtype`` nor a uint8 view of a 1-byte dtype.
    """
    if t.dtype == dtype:
        return t
    if t.dtype == torch.uint8 and dtype.itemsize == 1:
        return t.view(dtype)
    raise ValueError(f"from_wire: t.dtype={t.dtype} cannot be viewed as dtype={dtype}; only uint8 "
                     "payloads of a 1-byte dtype are re-typed")
