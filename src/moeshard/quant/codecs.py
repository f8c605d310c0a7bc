"""Codecs: how one quantized scheme stores weights ``[E, N, K]`` and activations ``[M, K]``.

Shape legend: ``E`` experts, ``N`` output features (rows of a weight), ``K`` input features
(columns), ``M`` activation rows. A codec is stateless; ``QuantizedWeight`` and
``QuantizedActivations`` (``tensors.py``) hold the tensors and ask their scheme's codec for every
layout, quantize, dequantize and slice decision, so a new scheme is one codec class plus one
registry entry (``schemes.py``).

=============  ==============================================  ==============================================
codec          weights ``[E, N, K]``                           activations ``[M, K]``
=============  ==============================================  ==============================================
Fp8Tensor      e4m3; fp32 scale ``[E]`` (amax of ``w[e]``)     e4m3; fp32 ``tensor_scale`` ``[]`` (or
                                                               ``[M, 1]`` from a per-row ``amax`` override)
Fp8Token       e4m3; fp32 scale ``[E, N]`` (per output row)    e4m3; fp32 ``row_scale [M, 1]``
Fp8Block       e4m3; fp32 scale ``[E, ceil(N/128),             e4m3; fp32 ``row_scale [M, ceil(K/128)]``
               ceil(K/128)]`` per 128 x 128 tile               (1 x 128 groups)
Nvfp4          e2m1 packed uint8 ``[E, N, K/2]``; e4m3 block   e2m1 packed uint8 ``[M, K/2]``; e4m3
               scale ``[E, N, K/16]``; fp32 global ``[E]``     ``row_scale [M, K/16]``; fp32 global
                                                               ``tensor_scale []`` (or ``[M, 1]``)
=============  ==============================================  ==============================================

Every function is pure torch with no host read-back (CPU and CUDA alike, graph-capturable).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .fp8 import FP8_DTYPE, abs_amax, block_amax, expand_blocks, fp8_dequantize, fp8_quantize, fp8_scale
from .nvfp4 import NVFP4_BLOCK, nvfp4_dequantize, nvfp4_global_scale, nvfp4_quantize

FP8_BLOCK = 128  # fp8_block: weight tiles are 128 x 128, activation groups 1 x 128


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Codec:
    """The storage of one quantized scheme. Subclasses set the class attributes and implement
    the methods; nothing here holds tensors.

    Attributes:
        data_dtype: stored element dtype of weights and activations (float8_e4m3fn, or uint8
            holding two packed values).
        pack: logical values per stored element along K (2 for packed fp4, else 1).
        k_multiple: K must be a multiple of this (block scales cannot straddle K's end).
        out_block / in_block: a slice of N / of K must start (and end, unless at the end of the
            dimension) on multiples of these, because one scale covers that many rows / columns.
        shared: weight fields with one value per expert that every slice keeps whole and that
            ``cat_out`` parts must share (``"scale"``, ``"global_scale"``).
        whole_expert_scale: some weight scale depends on the whole expert (a per-expert amax, or
            a per-row scale of the down projection across all of I), so a tensor-parallel shard
            must be quantized from the full expert and then sliced.
        weight_scale_dtype / has_global: the weight scale's dtype; whether there is an fp32
            per-expert global scale.
        row_scale_dtype: dtype of the activation scales that travel with each row (None: none).
        tensor_scale: activations carry one fp32 scale for all rows (``[]``, or ``[M, 1]`` per row
            when the caller's amax is per row), taken from the quantization domain's amax.
    """

    data_dtype: torch.dtype = FP8_DTYPE
    pack: int = 1
    k_multiple: int = 1
    out_block: int = 1
    in_block: int = 1
    shared: tuple[str, ...] = ()
    whole_expert_scale: bool = False
    weight_scale_dtype: torch.dtype = torch.float32
    has_global: bool = False
    row_scale_dtype: torch.dtype | None = None
    tensor_scale: bool = False

    # -- weights ----------------------------------------------------------------------------
    def weight_scale_shape(self, e: int, n: int, k: int) -> tuple[int, ...]:
        raise NotImplementedError

    def quantize_weight(self, w: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        """float ``[E, N, K]`` -> (data, scale, global scale or None)."""
        raise NotImplementedError

    def dequantize_weight(self, data: Tensor, scale: Tensor, glob: Tensor | None, shape: tuple[int, int, int]) -> Tensor:
        """fp32 ``[E, N, K]``."""
        raise NotImplementedError

    def scale_rows(self, scale: Tensor, start: int, stop: int) -> Tensor:
        """The weight scale of output rows ``[start, stop)`` (boundaries already checked)."""
        return scale if "scale" in self.shared else scale[:, start // self.out_block:_cdiv(stop, self.out_block)]

    def scale_cols(self, scale: Tensor, start: int, stop: int) -> Tensor:
        """The weight scale of input columns ``[start, stop)`` (boundaries already checked)."""
        if self.in_block == 1 or "scale" in self.shared:
            return scale
        return scale[..., start // self.in_block:_cdiv(stop, self.in_block)]

    # -- activations ------------------------------------------------------------------------
    def row_scale_shape(self, m: int, k: int) -> tuple[int, ...] | None:
        return None

    def quantize_activations(self, x: Tensor, tensor_amax: Tensor, source: Tensor) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """x float ``[M, K]`` -> (data, row_scale, tensor_scale). Per-row and per-group scales
        come from ``source`` (x's shape); per-tensor quantities from ``tensor_amax`` (fp32 ``[]``
        or ``[M, 1]``)."""
        raise NotImplementedError

    def dequantize_activations(self, data: Tensor, row_scale: Tensor | None, tensor_scale: Tensor | None,
                               shape: tuple[int, int]) -> Tensor:
        """fp32 ``[M, K]``."""
        raise NotImplementedError


class Fp8Tensor(Codec):
    """e4m3 with one fp32 scale per expert (weights) and per quantization domain (activations)."""

    shared = ("scale",)
    whole_expert_scale = True
    tensor_scale = True

    def weight_scale_shape(self, e, n, k):
        return (e,)

    def quantize_weight(self, w):
        scale = fp8_scale(abs_amax(w, (1, 2)))
        return fp8_quantize(w, scale[:, None, None]), scale, None

    def dequantize_weight(self, data, scale, glob, shape):
        return fp8_dequantize(data, scale[:, None, None])

    def quantize_activations(self, x, tensor_amax, source):
        scale = fp8_scale(tensor_amax)
        return fp8_quantize(x, scale), None, scale

    def dequantize_activations(self, data, row_scale, tensor_scale, shape):
        return fp8_dequantize(data, tensor_scale)


class Fp8Token(Codec):
    """e4m3 with an fp32 scale per output channel (weights) and per row (activations)."""

    whole_expert_scale = True  # down's per-row scale spans all of I
    row_scale_dtype = torch.float32

    def weight_scale_shape(self, e, n, k):
        return (e, n)

    def quantize_weight(self, w):
        scale = fp8_scale(abs_amax(w, (2,)))
        return fp8_quantize(w, scale[:, :, None]), scale, None

    def dequantize_weight(self, data, scale, glob, shape):
        return fp8_dequantize(data, scale[:, :, None])

    def row_scale_shape(self, m, k):
        return (m, 1)

    def quantize_activations(self, x, tensor_amax, source):
        scale = fp8_scale(abs_amax(source, (1,), keepdim=True))
        return fp8_quantize(x, scale), scale, None

    def dequantize_activations(self, data, row_scale, tensor_scale, shape):
        return fp8_dequantize(data, row_scale)


class Fp8Block(Codec):
    """e4m3 with an fp32 scale per 128 x 128 weight tile and per 1 x 128 activation group
    (DeepSeek-V3 checkpoints)."""

    out_block = FP8_BLOCK
    in_block = FP8_BLOCK
    row_scale_dtype = torch.float32

    def weight_scale_shape(self, e, n, k):
        return (e, _cdiv(n, FP8_BLOCK), _cdiv(k, FP8_BLOCK))

    def quantize_weight(self, w):
        n, k = w.shape[1:]
        scale = fp8_scale(block_amax(w, (FP8_BLOCK, FP8_BLOCK)))
        return fp8_quantize(w, expand_blocks(scale, (FP8_BLOCK, FP8_BLOCK), (n, k))), scale, None

    def dequantize_weight(self, data, scale, glob, shape):
        return fp8_dequantize(data, expand_blocks(scale, (FP8_BLOCK, FP8_BLOCK), shape[1:]))

    def row_scale_shape(self, m, k):
        return (m, _cdiv(k, FP8_BLOCK))

    def quantize_activations(self, x, tensor_amax, source):
        scale = fp8_scale(block_amax(source, (1, FP8_BLOCK)))
        return fp8_quantize(x, expand_blocks(scale, (1, FP8_BLOCK), tuple(x.shape))), scale, None

    def dequantize_activations(self, data, row_scale, tensor_scale, shape):
        return fp8_dequantize(data, expand_blocks(row_scale, (1, FP8_BLOCK), shape))


class Nvfp4(Codec):
    """e2m1 packed two per byte, an e4m3 scale per 16 values, an fp32 global scale per expert
    (weights) or per quantization domain (activations)."""

    data_dtype = torch.uint8
    pack = 2
    k_multiple = NVFP4_BLOCK
    in_block = NVFP4_BLOCK
    shared = ("global_scale",)
    whole_expert_scale = True
    weight_scale_dtype = FP8_DTYPE
    has_global = True
    row_scale_dtype = FP8_DTYPE
    tensor_scale = True

    def weight_scale_shape(self, e, n, k):
        return (e, n, k // NVFP4_BLOCK)

    def quantize_weight(self, w):
        glob = nvfp4_global_scale(abs_amax(w, (1, 2)))
        data, scale = nvfp4_quantize(w, glob[:, None, None])
        return data, scale, glob

    def dequantize_weight(self, data, scale, glob, shape):
        return nvfp4_dequantize(data, scale, glob[:, None, None])

    def row_scale_shape(self, m, k):
        return (m, k // NVFP4_BLOCK)

    def quantize_activations(self, x, tensor_amax, source):
        glob = nvfp4_global_scale(tensor_amax)
        data, block_scale = nvfp4_quantize(x, glob, None if source is x else source)
        return data, block_scale, glob

    def dequantize_activations(self, data, row_scale, tensor_scale, shape):
        return nvfp4_dequantize(data, row_scale, tensor_scale)
