"""The vectorised expert computation: rows grouped by expert, one grouped GEMM per projection.

    rows [M / repeat, H] --gather routed rows sorted by expert--> [M, H] --gate_up GEMM--> [M, 2 I_l]
        --act(gate) * up--> h [M, I_l] (model dtype; quantized per scheme)
        --down GEMM--> [M, H] --unsort--> [M, H]

Nothing here synchronises with the host on the ``torch._grouped_mm`` path: group offsets stay on
the device. ``GroupedExperts.gemm`` is the single seam that faster kernels override
(``moeshard.kernels``); its default dequantizes quantized operands and multiplies in fp32,
which is exactly what a block-scaled GEMM with fp32 accumulation computes.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from moeshard.experts.base import ExpertInput, ExpertWeights, Weight
from moeshard.quant import QuantizedActivations, QuantizedWeight, quantize_activations
from moeshard.tolerances import ACCUMULATION

PER_TENSOR_SCHEMES = ("fp8_tensor", "nvfp4")


def activate(gate_up: torch.Tensor, activation: str, out_dtype: torch.dtype) -> torch.Tensor:
    """gate_up: [M, 2 I] -> act(gate) * up in fp32, rounded to ``out_dtype``: [M, I]."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    if activation == "silu":
        h = F.silu(gate) * up
    elif activation == "gelu":
        h = F.gelu(gate) * up
    else:
        raise ValueError(f"activation: {activation!r} is not one of ['silu', 'gelu']")
    return h.to(out_dtype)


def expert_amax(h: torch.Tensor, expert_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Per-row amax of each row's expert group: fp32 [M, 1].

    Per-tensor activation scales of the down projection are taken per expert, over all rows that
    expert receives. Every layout gives an expert the same rows, so the scale is layout-free.
    """
    row_max = h.abs().amax(dim=1).float() if h.shape[1] else h.new_zeros(h.shape[0], dtype=torch.float32)
    seg = torch.zeros(num_experts, dtype=torch.float32, device=h.device)
    seg = seg.scatter_reduce(0, expert_ids, row_max, reduce="amax", include_self=True)
    return seg[expert_ids].unsqueeze(1)


def group_sizes(ids: torch.Tensor, num_groups: int) -> torch.Tensor:
    """int64 [num_groups]: how many of ``ids`` (int64 [M]) fall in each group.

    ``torch.bincount`` sizes its output from the data and so synchronises with the host on CUDA;
    a scatter-add into a fixed-size buffer does not, which keeps the forward graph-capturable.
    """
    counts = torch.zeros(num_groups, dtype=torch.int64, device=ids.device)
    return counts.scatter_add_(0, ids, torch.ones_like(ids))


@functools.cache
def _grouped_mm_works(device_type: str, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` runs here (it depends on torch version, device and dtype)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        device = torch.device(device_type)
        a = torch.ones(16, 16, dtype=dtype, device=device)
        b = torch.ones(2, 16, 16, dtype=dtype, device=device)
        offs = torch.tensor([8, 16], dtype=torch.int32, device=device)
        out = torch._grouped_mm(a, b.transpose(-2, -1), offs=offs)
        return bool(torch.all(out == 16))
    except (RuntimeError, NotImplementedError, TypeError):
        return False


class GroupedExperts:
    """Computes routed experts on grouped rows; stateless, holds no weights.

    activation: "silu" | "gelu"; out_dtype: the model dtype of the result.
    """

    def __init__(self, activation: str, out_dtype: torch.dtype) -> None:
        self.activation = activation
        self.out_dtype = out_dtype

    def accumulation(self, scheme: str) -> float:
        """Relative accumulation error of this kernel's GEMM sums for ``scheme`` (a fraction of
        sum |a| |b|, ``moeshard.tolerances.ACCUMULATION``): what the reference must allow."""
        return ACCUMULATION["fp32"]

    # -- the seam -------------------------------------------------------------------------
    def gemm(self, a: torch.Tensor | QuantizedActivations, w: Weight, offsets: torch.Tensor) -> torch.Tensor:
        """Grouped ``a @ w[e].T`` for each expert's contiguous rows.

        a: [M, K] sorted by expert (model dtype or quantized); w: [E_l, N, K];
        offsets: int32 [E_l], cumulative row ends. Returns [M, N] in ``out_dtype``.
        """
        if isinstance(w, QuantizedWeight):
            a32 = a.dequantize(torch.float32)
            return self._float_gemm(a32, w.dequantize(torch.float32), offsets).to(self.out_dtype)
        if isinstance(a, QuantizedActivations):
            raise TypeError("gemm: quantized activations with unquantized weights")
        return self._float_gemm(a, w, offsets).to(self.out_dtype)

    def _float_gemm(self, a: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        if a.dtype != w.dtype:
            raise TypeError(f"gemm: activations {a.dtype} and weights {w.dtype} differ")
        if _grouped_mm_works(a.device.type, a.dtype) and a.shape[1] % 8 == 0 and w.shape[1] % 8 == 0:
            return torch._grouped_mm(a, w.transpose(-2, -1), offs=offsets)
        out = a.new_empty(a.shape[0], w.shape[1])
        start = 0
        for e, end in enumerate(offsets.tolist()):  # host sync: fallback path only
            if end > start:
                out[start:end] = a[start:end] @ w[e].T
            start = end
        return out

    # -- the pipeline ---------------------------------------------------------------------
    def __call__(self, inp: ExpertInput, weights: ExpertWeights) -> torch.Tensor:
        """Returns [M, H] in ``out_dtype``: each routed row (x[m // inp.repeat]) through its expert, unweighted."""
        E_l, scheme = weights.num_experts, weights.scheme
        ids = inp.expert_ids
        order = torch.argsort(ids, stable=True)
        offsets = torch.cumsum(group_sizes(ids, E_l), 0).to(torch.int32)
        sorted_ids = ids[order]
        # Routed row m lives at row m // repeat of x (the local backend does not copy a token's K
        # routed rows); the gather below is the only place that materialises them. index_rows
        # gathers per-row scales (row_scale, and a per-row tensor_scale [M / repeat, 1]) with them.
        src = order // inp.repeat if inp.repeat > 1 else order
        x = inp.x.index_rows(src) if isinstance(inp.x, QuantizedActivations) else inp.x[src]
        if scheme != "none" and not isinstance(x, QuantizedActivations):
            # defer_input_quant: quantize here, with the layer-wide amax for per-tensor scales.
            x = quantize_activations(x, scheme, amax=inp.input_amax if scheme in PER_TENSOR_SCHEMES else None)
        h = activate(self.gemm(x, weights.gate_up, offsets), self.activation, self.out_dtype)
        if scheme != "none":
            amax = expert_amax(h, sorted_ids, E_l) if scheme in PER_TENSOR_SCHEMES else None
            h = quantize_activations(h, scheme, amax=amax)
        y_sorted = self.gemm(h, weights.down, offsets)
        y = torch.empty_like(y_sorted)
        y[order] = y_sorted
        return y
