"""The vectorised expert computation: rows grouped by expert, one grouped GEMM per projection.

    rows [M / repeat, H] --gather routed rows sorted by expert--> [M, H] --gate_up GEMM--> [M, 2 I_l]
        (+ gate_up bias) --act(gate) * up--> h [M, I_l] (model dtype; quantized per scheme)
        --down GEMM--> [M, H] (+ down bias) --unsort--> [M, H]

Expert biases (``ExpertWeights.gate_up_bias`` / ``down_bias``) are added in fp32 to the GEMM's
model-dtype output, each row its expert's, and the sum rounded to the model dtype again (the
product rounds first, as a model that adds its bias after the matmul computes it).

Padding rows (expert id -1) sort after every expert, past the last group offset: no GEMM
computes them, they take no bias and their output rows are zero (in training their gradient
reaches neither x nor a weight nor a bias). Both layouts are accepted (``EXPERT_BLOCKS``
carries per-row expert ids too). Nothing here synchronises with the host on the
``torch._grouped_mm`` path: group offsets stay on the device. ``GroupedExperts.gemm`` is the
seam for a faster GEMM inside this pipeline (gather, grouped GEMMs, activation, unsort); its
default dequantizes quantized operands and multiplies in fp32, which is exactly what a
block-scaled GEMM with fp32 accumulation computes. A kernel that fuses the whole pipeline (the
Triton ``TritonExperts``) replaces ``__call__`` instead and keeps this class's portable path for
what it does not run. Any registered scheme runs here (through its codec).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from moeshard.activations import get_activation
from moeshard.experts.base import EXPERT_BLOCKS, FLAT, ExpertInput, ExpertWeights, Weight, activate
from moeshard.numerics import ACCUMULATION
from moeshard.quant import QuantizedActivations, QuantizedWeight, get_scheme, quantize_activations
from moeshard.triton_env import triton_importable


def expert_amax(h: torch.Tensor, expert_ids: torch.Tensor, num_experts: int,
                reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """Per-row amax of each row's expert group: fp32 [M, 1].

    expert_ids: int64 [M] in [0, num_experts], where ``num_experts`` marks padding rows (their
    group is their own and never mixes with an expert's). Per-tensor activation scales of the
    down projection are taken per expert, over all rows that expert receives. Every layout gives
    an expert the same rows, so the scale is layout-free. reduce: ``ExpertInput.amax_reduce``,
    applied to the experts' amax [num_experts] (replicas of one expert on several ranks).
    """
    row_max = h.abs().amax(dim=1).float() if h.shape[1] else h.new_zeros(h.shape[0], dtype=torch.float32)
    seg = torch.zeros(num_experts + 1, dtype=torch.float32, device=h.device)
    seg = seg.scatter_reduce(0, expert_ids, row_max, reduce="amax", include_self=True)
    if reduce is not None:
        seg = torch.cat([reduce(seg[:num_experts]), seg[num_experts:]])
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


class RepeatedRows(torch.autograd.Function):
    """rows = x[order // repeat]: the M routed rows sorted by expert, from x [M / repeat, H]
    holding each token once (the ``local`` backend's ``repeat = K``).

    The backward sums each token's K row gradients in fp32 and rounds once: the rows' gradients
    are gathered back in token-major order through ``inverse`` (the inverse permutation of
    ``order``) and summed over K. The plain ``x[src]`` backward accumulates the K gradients into
    x's rows with atomic adds in the model dtype instead: slower, order-dependent, rounded K times.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor, repeat: int) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        ctx.repeat = repeat
        return x[order // repeat]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (inverse,) = ctx.saved_tensors
        T, H = grad.shape[0] // ctx.repeat, grad.shape[1]
        token_major = grad[inverse].view(T, ctx.repeat, H)
        return token_major.sum(dim=1, dtype=torch.float32).to(grad.dtype), None, None, None


class PermutedRows(torch.autograd.Function):
    """rows = t[index] for a permutation ``index`` of t's rows, whose backward is the gather
    grad[inverse] (``inverse`` the inverse permutation): no accumulating indexed store, which is
    what the backward of a plain ``t[index]`` runs (it cannot know that no row repeats)."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        return t[index]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (inverse,) = ctx.saved_tensors
        return grad[inverse], None, None


def inverse_permutation(order: torch.Tensor) -> torch.Tensor:
    """int64 [M]: inv with inv[order[i]] = i (one scatter of M indices; no sort, no host sync)."""
    return torch.empty_like(order).scatter_(0, order, torch.arange(order.shape[0], device=order.device))


class GroupedExperts:
    """Computes routed experts on grouped rows; stateless, holds no weights.

    activation: a registered kind (``moeshard.activations``); out_dtype: the model dtype of the result.
    """

    layouts: tuple[str, ...] = (FLAT, EXPERT_BLOCKS)

    def __init__(self, activation: str, out_dtype: torch.dtype) -> None:
        get_activation(activation, f"{type(self).__name__}: activation")  # refused here, not at the first call
        self.activation = activation
        self.out_dtype = out_dtype

    def accumulation(self, scheme: str) -> float:
        """Relative accumulation error of this kernel's GEMM sums for ``scheme`` (a fraction of
        sum |a| |b|, ``moeshard.numerics.ACCUMULATION``): what the reference must allow."""
        return ACCUMULATION["fp32"]

    # -- the seam -------------------------------------------------------------------------
    def gemm(self, a: torch.Tensor | QuantizedActivations, w: Weight, offsets: torch.Tensor,
             padded: bool = True) -> torch.Tensor:
        """Grouped ``a @ w[e].T`` for each expert's contiguous rows.

        a: [M, K] sorted by expert (model dtype or quantized); w: [E_l, N, K];
        offsets: int32 [E_l], cumulative row ends. Returns [M, N] in ``out_dtype``. padded: rows
        past ``offsets[-1]`` may exist (False: ``offsets[-1]`` is M).
        """
        if isinstance(w, QuantizedWeight):
            if not isinstance(a, QuantizedActivations):
                raise TypeError("gemm: unquantized activations with quantized weights")
            a32 = a.dequantize(torch.float32)
            return self._float_gemm(a32, w.dequantize(torch.float32), offsets, padded).to(self.out_dtype)
        if isinstance(a, QuantizedActivations):
            raise TypeError("gemm: quantized activations with unquantized weights")
        return self._float_gemm(a, w, offsets, padded).to(self.out_dtype)

    def _float_gemm(self, a: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, padded: bool = True) -> torch.Tensor:
        if a.dtype != w.dtype:
            raise TypeError(f"gemm: activations {a.dtype} and weights {w.dtype} differ")
        if _grouped_mm_works(a.device.type, a.dtype) and a.shape[1] % 8 == 0 and w.shape[1] % 8 == 0:
            if padded and torch.is_grad_enabled() and (a.requires_grad or w.requires_grad) and a.shape[0]:
                # Training: _grouped_mm's backward leaves the gradient of rows past the last
                # offset (padding) unwritten; the masked_fill's backward zeroes it.
                a = a.masked_fill((torch.arange(a.shape[0], device=a.device) >= offsets[-1]).unsqueeze(1), 0)
            return torch._grouped_mm(a, w.transpose(-2, -1), offs=offsets)
        out = a.new_zeros(a.shape[0], w.shape[1])
        start = 0
        for e, end in enumerate(offsets.tolist()):  # host sync: fallback path only
            if end > start:
                out[start:end] = a[start:end] @ w[e].T
            start = end
        return out

    def _biased(self, out: torch.Tensor, bias: torch.Tensor | None, rows: torch.Tensor,
                padding: torch.Tensor) -> torch.Tensor:
        """out [M, N] (model dtype, rows sorted by expert) + bias[rows] ([E_l, N]), in fp32, rounded
        to ``out_dtype``; ``out`` itself without a bias. padding: bool [M], the padding rows, which
        take no bias: the grouped GEMM never writes their rows (any value, NaN too), so their
        gradient may be NaN, and a ``where`` (not a product with 0) keeps it from the bias."""
        if bias is None:
            return out
        return (out.float() + torch.where(padding.unsqueeze(1), 0.0, bias.float()[rows])).to(self.out_dtype)

    def _activate(self, gate_up: torch.Tensor) -> torch.Tensor:
        """h [M, I] in ``out_dtype`` from gate_up [M, 2I] ([M, I] ungated): ``activate``; a CUDA
        forward that carries gradients, of a gated kind with a kernel mode, runs the one-pass Triton
        activation and its one-pass backward (``kernels/glu.py``; the same values up to the last
        bit of fp32). An ungated kind's (one elementwise op of one product) stays torch's."""
        kind = get_activation(self.activation)
        if (gate_up.is_cuda and gate_up.requires_grad and torch.is_grad_enabled()
                and kind.gated and kind.kernel_mode is not None and triton_importable()[0]):
            from moeshard.kernels.glu import GatedActivation
            return GatedActivation.apply(gate_up, self.activation, self.out_dtype)
        return activate(gate_up, self.activation, self.out_dtype)

    # -- the pipeline ---------------------------------------------------------------------
    def __call__(self, inp: ExpertInput, weights: ExpertWeights) -> torch.Tensor:
        """Returns [M, H] in ``out_dtype``: each routed row (x[m // inp.repeat]) through its expert, unweighted."""
        E_l, scheme = weights.num_experts, get_scheme(weights.scheme, "ExpertWeights.scheme")
        # Padding rows (-1) become group E_l: they sort last, past the offsets of the real groups.
        ids = torch.where(inp.expert_ids < 0, E_l, inp.expert_ids)
        order = torch.argsort(ids, stable=True)
        # Rows go back to input order by a gather through the inverse permutation: a vectorised
        # copy, where an indexed store (y[order] = ...) runs at a fraction of the bandwidth.
        inverse = inverse_permutation(order)
        offsets = torch.cumsum(group_sizes(ids, E_l + 1), 0)[:E_l].to(torch.int32)
        sorted_ids = ids[order]
        # Routed row m lives at row m // repeat of x (the local backend does not copy a token's K
        # routed rows); the gather below is the only place that materialises them. index_rows
        # gathers per-row scales (row_scale, and a per-row tensor_scale [M / repeat, 1]) with them.
        src = order // inp.repeat if inp.repeat > 1 else order
        x: torch.Tensor | QuantizedActivations
        if isinstance(inp.x, QuantizedActivations):
            x = inp.x.index_rows(src)
        elif inp.repeat > 1 and torch.is_grad_enabled() and inp.x.requires_grad:
            x = RepeatedRows.apply(inp.x, order, inverse, inp.repeat)
        else:
            x = inp.x[src]
        if scheme.quantized and not isinstance(x, QuantizedActivations):
            # defer_input_quant: quantize here, with the layer-wide amax for per-tensor scales.
            x = quantize_activations(x, scheme.name, amax=inp.input_amax if scheme.per_tensor_activation else None)
        # Padding rows index the last expert's biases, then take none (``_biased``).
        padding = sorted_ids == E_l
        bias_rows = sorted_ids.clamp(max=E_l - 1) if weights.has_bias else sorted_ids
        h = self._activate(self._biased(self.gemm(x, weights.gate_up, offsets, inp.padded), weights.gate_up_bias,
                                        bias_rows, padding))
        h_in: torch.Tensor | QuantizedActivations = h
        if scheme.quantized:
            amax = expert_amax(h, sorted_ids, E_l, inp.amax_reduce) if scheme.per_tensor_activation else None
            h_in = quantize_activations(h, scheme.name, amax=amax)
        y_sorted = self._biased(self.gemm(h_in, weights.down, offsets, inp.padded), weights.down_bias, bias_rows,
                                padding)
        if inp.padded:  # rows past the last offset (padding) were never computed
            y_sorted = y_sorted.masked_fill(padding.unsqueeze(1), 0)
        if torch.is_grad_enabled() and y_sorted.requires_grad:
            return PermutedRows.apply(y_sorted, inverse, order)
        return y_sorted[inverse]
