"""The quantization schemes: one ``QuantScheme`` descriptor each, in one registry.

Every place that depends on the scheme reads its descriptor: the configuration's validation,
the containers and quantize functions (through ``codec``), tensor-parallel slice alignment,
the experts' per-tensor scale domains, the Triton kernels' mode, the checkpoint reader, the
quantization-error bound of the check. Adding a scheme is one ``register_scheme`` call with a
codec (``moeshard.quant.codecs``); see CONTRIBUTING.md.

Kernel modes (``kernel_mode``, one numbering for every Triton kernel, ``moeshard.kernels``):

====  ==========================================================================
mode  arithmetic
====  ==========================================================================
0     none: model-dtype operands
1     fp8, one scale per tensor (per expert for weights; per row of h)
2     fp8, a scale per row of the activations and per output channel of weights
3     fp8, a scale per 1 x 128 activation group and per 128 x 128 weight tile
4     nvfp4: e2m1 with e4m3 scales per 16 values and fp32 global scales
====  ==========================================================================

A scheme without a kernel mode runs on the portable ``GroupedExperts`` only; the Triton kernels
refuse it with that reason.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from moeshard.registry import Registry

from .codecs import Codec, Fp8Block, Fp8Tensor, Fp8Token, Nvfp4

KERNEL_MODES = {0: "none", 1: "fp8 per tensor", 2: "fp8 per row / channel", 3: "fp8 block", 4: "nvfp4"}


@dataclass(frozen=True)
class QuantScheme:
    """One quantization scheme of the routed experts.

    name: what ``QuantConfig.scheme`` says; codec: the storage and arithmetic of quantized
    weights and activations (None for ``"none"``); kernel_mode: its mode in the Triton kernels
    (``KERNEL_MODES``), None where they have none; quant_error: the bound on the relative RMS
    error of the quantized layer against the unquantized one (fp64 references, quantization
    error alone), checked per case by ``moeshard check``; summary: one line for tables.
    """

    name: str
    codec: Codec | None
    kernel_mode: int | None
    quant_error: float
    summary: str

    @property
    def quantized(self) -> bool:
        return self.codec is not None

    @property
    def per_tensor_activation(self) -> bool:
        """Activation scales over a whole quantization domain (the layer all-reduces the amax
        over the EP group, the down projection takes it per expert)."""
        return self.codec is not None and self.codec.tensor_scale

    @property
    def slice_align(self) -> int:
        """A tensor-parallel slice of the intermediate dimension must start and end on multiples
        of this: gate/up rows are sliced along N, down columns along K."""
        if self.codec is None:
            return 1
        return math.lcm(self.codec.out_block, self.codec.in_block, self.codec.k_multiple)

    @property
    def dim_multiple(self) -> int:
        """hidden_size and every intermediate slice must be multiples of this (K of some GEMM)."""
        return 1 if self.codec is None else self.codec.k_multiple

    @property
    def whole_expert_scale(self) -> bool:
        """A TP shard needs the whole expert to be quantized first (see ``Codec``)."""
        return self.codec is not None and self.codec.whole_expert_scale


_REGISTRY: Registry[QuantScheme] = Registry()


def _check_complete(scheme: QuantScheme) -> None:
    where = f"register_scheme({scheme.name!r})"
    if not isinstance(scheme.name, str) or not scheme.name.isidentifier():
        raise ValueError(f"{where}: name must be an identifier, got {scheme.name!r}")
    if scheme.name in _REGISTRY:
        raise ValueError(f"{where}: a scheme of that name is registered already")
    if scheme.codec is None and scheme.name != "none":
        raise ValueError(f"{where}: only 'none' may have no codec")
    if scheme.kernel_mode is not None:
        taken = {s.kernel_mode: s.name for s in _REGISTRY.values() if s.kernel_mode is not None}
        if scheme.kernel_mode not in KERNEL_MODES or scheme.kernel_mode in taken:
            raise ValueError(f"{where}: kernel_mode {scheme.kernel_mode!r} is not a free mode of {KERNEL_MODES} "
                             f"(taken: {taken})")
    if not (isinstance(scheme.quant_error, float) and 0 <= scheme.quant_error < 1):
        raise ValueError(f"{where}: quant_error must be a float in [0, 1), got {scheme.quant_error!r}")
    codec = scheme.codec
    if codec is not None:
        for attr in ("out_block", "in_block", "k_multiple", "pack"):
            value = getattr(codec, attr)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{where}: codec.{attr} must be an int >= 1, got {value!r}")
        if codec.data_dtype.itemsize != 1:
            raise ValueError(f"{where}: codec.data_dtype must be a 1-byte dtype (it crosses the wire as uint8), "
                             f"got {codec.data_dtype}")


def register_scheme(scheme: QuantScheme) -> QuantScheme:
    """Adds ``scheme`` to the registry after checking it is complete; returns it."""
    _check_complete(scheme)
    _REGISTRY.add(scheme.name, scheme)
    return scheme


def unregister_scheme(name: str) -> None:
    """Removes a scheme (tests that register one of their own clean up with this)."""
    _REGISTRY.remove(name)


def scheme_names() -> tuple[str, ...]:
    """Every registered scheme, ``"none"`` first."""
    return _REGISTRY.names()


def get_scheme(name: str, where: str = "quant") -> QuantScheme:
    """The descriptor of ``name``; ``ValueError`` naming ``where``, the value and the known schemes."""
    return _REGISTRY.get(name, where)


def quantized_scheme(name: str, where: str) -> QuantScheme:
    """The descriptor of a quantized scheme; ``ValueError`` for ``"none"`` or unknown names."""
    scheme = _REGISTRY.lookup(name)
    if scheme is None or scheme.codec is None:
        known = [s for s, d in _REGISTRY.items() if d.codec is not None]
        raise ValueError(f"{where}: scheme {name!r} is not a quantized scheme; expected one of {known}")
    return scheme


for _scheme in (
    QuantScheme("none", None, 0, 0.0, "model dtype (fp32 / bf16 / fp16)"),
    QuantScheme("fp8_tensor", Fp8Tensor(), 1, 0.10, "e4m3; one scale per expert; activations per tensor"),
    QuantScheme("fp8_token", Fp8Token(), 2, 0.10, "e4m3; scale per output channel; activations per token"),
    QuantScheme("fp8_block", Fp8Block(), 3, 0.10, "e4m3; scale per 128x128 tile; activations per 1x128"),
    QuantScheme("nvfp4", Nvfp4(), 4, 0.30, "e2m1; e4m3 scale per 16; fp32 global scale"),
):
    register_scheme(_scheme)

BUILTIN_SCHEMES = scheme_names()
