"""Quantized expert weights and activations (fp8 e4m3 and NVFP4), pure torch, CPU and CUDA.

One descriptor per scheme lives in the registry (``schemes.py``: ``get_scheme``,
``register_scheme``); its codec (``codecs.py``, which tabulates every built-in scheme's weight
and activation layouts) stores and computes the scheme. ``'none'`` means no quantization and has
no codec.

Scale conventions (every ``amax`` is first raised to ``AMAX_FLOOR = 1e-12`` so that an all-zero
tensor, row or block quantizes to zeros instead of NaN/Inf):

* fp8 (all three fp8 schemes; ``amax`` of the tensor / row / tile / group the scale covers)::

      scale = amax / 448                                   (fp32)
      q     = clamp(x / scale, -448, 448).to(float8_e4m3fn)
      x    ~= q.float() * scale

* nvfp4 (NVIDIA's convention; ``amax`` per expert for weights, per tensor or per row for
  activations; ``block_amax`` over 16 consecutive values along K)::

      g = (448 * 6) / amax                                 (fp32 global scale)
      s = float8_e4m3fn(min((block_amax / 6) * g, 448))    (block scale)
      q = e2m1(x * g / s.float())                          (0 where s == 0)
      x ~= e2m1_value(q) * s.float() / g

  e2m1 magnitudes ``0, 0.5, 1, 1.5, 2, 3, 4, 6`` (codes 0..7, sign bit 0x8), round to nearest,
  ties to the even code, saturating at 6; two codes per byte, element ``2i`` in the low nibble.
  Block scales are kept unswizzled; ``swizzle_scales`` makes the 128x4-tile kernel layout
  after dispatch.

Every division is correctly rounded fp32 (constants are device tensors, not Python numbers, see
``fp8.const``), so CPU and CUDA produce bit-identical scales and payloads.

Error bounds of quantize -> dequantize (per element, proven in ``tests/test_quant.py``):

* fp8: ``|x - x'| <= max(2^-4 |x|, 2^-10 * scale)`` (3 mantissa bits; e4m3 subnormal step
  2^-9 below 2^-6), hence ``<= 2^-4 * amax`` of the element's scale group.
* nvfp4: ``|x - x'| <= (1/4) * max(|x|, (17/16) * block_amax / 6)`` while the block scale is an
  e4m3 normal, i.e. ``block_amax / amax >= 2^-6 / 448`` (~3.5e-5; below that the subnormal block
  scale loses precision, and under 2^-10 / 448 the block becomes 0): e2m1 rounds to within a
  quarter of ``max(|y|, 1)`` (relative 1/4 above 1, absolute 1/4 below), and e4m3 rounding makes
  ``s`` at most ``(1 + 2^-4)`` times ``(block_amax / 6) * g``.

Activations can be quantized with an ``amax`` override (an all-reduced or per-row expert-group
amax) so that every parallel layout quantizes a row identically. Payloads cross the wire as
uint8 views (``to_wire`` / ``from_wire``), since gloo cannot send float8.
"""

from .codecs import FP8_BLOCK, Codec
from .fp8 import AMAX_FLOOR, FP8_DTYPE, FP8_MAX, fp8_dequantize, fp8_quantize, fp8_scale, from_wire, to_wire
from .nvfp4 import (
    E2M1_MAX,
    E2M1_VALUES,
    NVFP4_BLOCK,
    e2m1_decode,
    e2m1_encode,
    nvfp4_dequantize,
    nvfp4_global_scale,
    nvfp4_quantize,
    pack_fp4,
    swizzle_scales,
    swizzled_shape,
    unpack_fp4,
    unswizzle_scales,
)
from .schemes import (
    BUILTIN_SCHEMES,
    KERNEL_MODES,
    QuantScheme,
    get_scheme,
    quantized_scheme,
    register_scheme,
    scheme_names,
    unregister_scheme,
)
from .tensors import (
    SCHEMES,
    QuantizedActivations,
    QuantizedWeight,
    fake_quantize_activations,
    quantize_activations,
    quantize_weight,
)

__all__ = [
    "BUILTIN_SCHEMES", "KERNEL_MODES", "Codec", "QuantScheme", "get_scheme", "quantized_scheme", "register_scheme",
    "scheme_names", "unregister_scheme",
    "AMAX_FLOOR", "E2M1_MAX", "E2M1_VALUES", "FP8_BLOCK", "FP8_DTYPE", "FP8_MAX", "NVFP4_BLOCK", "SCHEMES",
    "QuantizedActivations", "QuantizedWeight",
    "e2m1_decode", "e2m1_encode", "fake_quantize_activations", "fp8_dequantize", "fp8_quantize", "fp8_scale",
    "from_wire", "nvfp4_dequantize", "nvfp4_global_scale", "nvfp4_quantize", "pack_fp4", "quantize_activations",
    "quantize_weight", "swizzle_scales", "swizzled_shape", "to_wire", "unpack_fp4", "unswizzle_scales",
]
