"""Quantize before dispatch, and rebuild the experts' input after it: the wire format.

    x [T, H] --prepare--> Payload: rows [T, Hp] (model dtype, or a uint8 view of quantized data)
                                   + row_scale [T, S] (wire view) + what is needed to rebuild
    (a backend moves rows and row scales, in whatever messages it likes)
    received rows --Payload.expert_input--> ExpertInput (QuantizedActivations rebuilt, or the
                                   model-dtype rows that the experts quantize themselves)

Per-tensor activation scales (``QuantScheme.per_tensor_activation``: fp8_tensor, nvfp4's global
scale) are dynamic over the layer's quantization domain: ``prepare`` all-reduces the amax of x
over the backend's group (the EP group; none without EP, where a rank's tokens are the domain),
so the one scalar scale is identical on every rank and the single-device reference over the
domain's tokens reproduces it. Row scales travel with their rows; scales are rearranged into a
kernel's layout (e.g. nvfp4's swizzle) only after dispatch, never before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from moeshard.config import QuantConfig
from moeshard.experts.base import ExpertInput
from moeshard.kernels import fused_input_quant
from moeshard.parallel.collectives import all_reduce
from moeshard.parallel.trace import CollectiveTrace
from moeshard.quant import QuantizedActivations, from_wire, quantize_activations, to_wire
from moeshard.quant.fp8 import abs_amax
from moeshard.stages import StageRecorder


@dataclass(frozen=True)
class Payload:
    """This rank's tokens as they leave for dispatch.

    rows: [T, Hp]: the model dtype (scheme ``none``, or deferred quantization: the experts
       quantize), or a uint8 view of the quantized data (Hp = H / codec.pack).
    row_scale: [T, S] wire view (uint8 for 1-byte scales, else fp32) of the per-row scales, or
       None (unquantized, deferred, or a scheme without row scales).
    scheme: the quantized scheme of ``rows``, None when they are in the model dtype.
    data_dtype, scale_dtype: the dtypes of rows and row scales before ``to_wire``.
    tensor_scale: fp32 [] the per-tensor scale of the quantized rows, or None; identical on every
       rank of the quantization domain, so it never travels.
    input_amax: fp32 [] amax of the quantization domain for per-tensor schemes (deferred
       quantization uses it on the receiving side), else None.
    """

    rows: torch.Tensor
    row_scale: torch.Tensor | None
    scheme: str | None
    data_dtype: torch.dtype
    scale_dtype: torch.dtype | None
    tensor_scale: torch.Tensor | None
    input_amax: torch.Tensor | None

    def expert_input(self, rows: torch.Tensor, row_scale: torch.Tensor | None, expert_ids: torch.Tensor,
                     repeat: int = 1, block_counts: torch.Tensor | None = None, padded: bool = True) -> ExpertInput:
        """The experts' input from received rows (wire views of ``self.rows``' kind, any count):
        rows [M / repeat, Hp], row_scale [M / repeat, S] or None, expert_ids int64 [M]."""
        x: torch.Tensor | QuantizedActivations = rows
        if self.scheme is not None:
            scale = None if row_scale is None or self.scale_dtype is None else from_wire(row_scale, self.scale_dtype)
            x = QuantizedActivations(self.scheme, from_wire(rows, self.data_dtype), scale, self.tensor_scale)
        return ExpertInput(x, expert_ids, self.input_amax, repeat=repeat, block_counts=block_counts, padded=padded)


def domain_amax(x: torch.Tensor, group: Any, trace: CollectiveTrace | None = None, fused: bool = False) -> torch.Tensor:
    """fp32 []: amax of |x| over every rank of ``group`` (0 for no rows anywhere); ``group``
    None: this rank's x alone. One all-reduce of one scalar, no host synchronisation. fused:
    this rank's amax by the one-pass kernel (``kernels.quant_rows.input_amax``; the same value)."""
    if fused:
        from moeshard.kernels.quant_rows import input_amax
        amax = input_amax(x)
    else:
        amax = abs_amax(x, (0, 1))
    if group is not None:
        all_reduce(amax, group, "ep", "max", trace=trace)
    return amax


def prepare(x: torch.Tensor, quant: QuantConfig, group: Any = None, trace: CollectiveTrace | None = None,
            recorder: StageRecorder | None = None) -> Payload:
    """x: [T, H] this rank's tokens in the model dtype -> the ``Payload`` a backend moves.

    group: the quantization domain's process group (the EP group; None without EP). Collective
    over ``group`` for per-tensor schemes (every rank calls it, T may be 0). trace: the rank's
    ``CollectiveTrace`` (``ParallelGroups.trace``), or None; recorder: the layer's
    ``StageRecorder`` (the backend's ``recorder``), which gets the payload, or None.
    """
    scheme = quant.spec
    # On CUDA the fp8 schemes and nvfp4 quantize in one fused pass (bit for bit the torch path's result).
    fused = scheme.quantized and fused_input_quant(x.device, scheme.name) and x.stride(-1) == 1
    amax = domain_amax(x, group, trace, fused) if scheme.per_tensor_activation else None
    if not scheme.quantized or quant.defer_input_quant:
        payload = Payload(x, None, None, x.dtype, None, None, amax)
    else:
        if fused:
            from moeshard.kernels.quant_rows import quantize_rows
            q = quantize_rows(x, scheme.name, amax=amax)
        else:
            q = quantize_activations(x, scheme.name, amax=amax)
        row_scale = None if q.row_scale is None else to_wire(q.row_scale)
        payload = Payload(to_wire(q.data), row_scale, scheme.name, q.data.dtype,
                          None if q.row_scale is None else q.row_scale.dtype, q.tensor_scale, amax)
    if recorder is not None:
        recorder.record("payload", rows=payload.rows, row_scale=payload.row_scale, tensor_scale=payload.tensor_scale,
                        input_amax=amax)
    return payload
