"""The shared experts quantized (``QuantConfig.shared``): the fused shared MLP run as the one
expert of an expert kernel, every row routed to it.

The shared MLP down(act(gate(x)) * up(x)) is an expert like the routed ones: gate_up = [gate;
up] [1, 2S, H] and down [1, H, S], quantized with the scheme as the routed experts are (scales
per expert, here the one). Its input is quantized per row or per block (``QuantConfig`` refuses
per-tensor activation scales for the shared experts), so each row's output depends on that row
alone, on every layout. The reference (``moeshard.reference``) computes it the same way.
"""

from __future__ import annotations

import torch

from moeshard.experts.base import ExpertInput, ExpertKernel, ExpertWeights
from moeshard.quant import QuantizedActivations, QuantizedWeight, get_scheme, quantize_activations, quantize_weight


def shared_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up: [S, H] (the fused shared MLP's) -> gate_up [1, 2S, H], the routed experts'
    layout (rows [0, S) gate, [S, 2S) up) for one expert."""
    return torch.cat([gate, up]).unsqueeze(0)


class QuantizedSharedMLP:
    """The fused shared MLP with its weights and input quantized with ``scheme``, computed by
    ``kernel`` (an expert kernel of the layer's device: ``select_kernel``; one of its own, as it
    may run on a side stream beside the routed experts' kernel).

    The quantized weights are made from the model-dtype weights on first use and again whenever
    those change (other tensors, as after ``.to``, or written in place, as ``load_state_dict``
    does: torch counts in-place writes in ``_version``). A write that torch does not count is
    not seen: one through ``.data`` (``p.data.copy_(w)``, as some weight-averaging code writes)
    leaves ``_version`` as it was, and the quantized weights of before stay in use. Write into
    the parameter itself under ``torch.no_grad()`` (``p.copy_(w)``) or assign a new tensor.

    stored: the shared MLP already quantized with ``scheme`` as one expert (gate_up [1, 2S, H],
    down [1, H, S]), as an fp8 checkpoint stores it. It is used, not requantized, whenever the
    model-dtype weights are exactly its dequantization in their dtype (checked when they change),
    so a checkpoint's codes and scales run as stored; other weights are quantized as above. The
    check reads one value back to the host, only when the weights changed (the first forward, a
    ``load_state_dict``).
    """

    def __init__(self, scheme: str, kernel: ExpertKernel, stored: ExpertWeights | None = None) -> None:
        spec = get_scheme(scheme, "QuantizedSharedMLP: scheme")
        if not spec.quantized or spec.per_tensor_activation:
            raise ValueError(f"QuantizedSharedMLP: scheme must be quantized with per-row or per-block activation "
                             f"scales, got {scheme!r}")
        if stored is not None and stored.scheme != scheme:
            raise ValueError(f"QuantizedSharedMLP: stored weights are {stored.scheme!r}, the shared experts run "
                             f"{scheme!r}")
        self.scheme = scheme
        self.kernel = kernel
        self.stored = stored
        self._key: tuple | None = None
        self._weights: ExpertWeights | None = None

    def weights(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> ExpertWeights:
        """gate, up: [S, H]; down: [H, S] (model dtype) -> the one expert's ``ExpertWeights``,
        quantized (made again only when a weight changed since the last call)."""
        key = tuple((t.data_ptr(), t._version, t.device, t.shape) for t in (gate, up, down))
        if key != self._key or self._weights is None:
            with torch.no_grad():
                gate_up = shared_gate_up(gate, up)
                stored = self._stored_for(gate_up, down)
                self._weights = stored or ExpertWeights(quantize_weight(gate_up, self.scheme),
                                                        quantize_weight(down.unsqueeze(0), self.scheme), self.scheme)
            self._key = key
        return self._weights

    def _stored_for(self, gate_up: torch.Tensor, down: torch.Tensor) -> ExpertWeights | None:
        """``stored`` on the weights' device when gate_up [1, 2S, H] and down [H, S] are exactly
        its dequantization in their dtype, else None."""
        if self.stored is None or (self.stored.gate_up.shape, self.stored.down.shape) != (
                tuple(gate_up.shape), (1, *down.shape)):
            return None
        stored = self.stored.to(gate_up.device)
        for w, q in ((gate_up, stored.gate_up), (down.unsqueeze(0), stored.down)):
            if not isinstance(q, QuantizedWeight) or not torch.equal(q.dequantize(torch.float32).to(w.dtype), w):
                return None
        return stored

    def quantize_input(self, x: torch.Tensor) -> QuantizedActivations:
        """x: [T, H] model dtype -> its rows quantized with the scheme (per row or per block):
        on CUDA in one fused pass where the kernels have one, else the torch path (same bits)."""
        from moeshard.kernels import fused_input_quant

        if x.stride(-1) == 1 and fused_input_quant(x.device, self.scheme):
            from moeshard.kernels.quant_rows import quantize_rows
            return quantize_rows(x, self.scheme)
        return quantize_activations(x, self.scheme)

    def __call__(self, x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
        """x: [T, H] model dtype -> [T, H] model dtype: down(act(gate x) * up x) on the quantized
        weights and input, h quantized with the scheme as the routed experts quantize theirs."""
        ids = torch.zeros(x.shape[0], dtype=torch.int64, device=x.device)
        return self.kernel(ExpertInput(self.quantize_input(x), ids, padded=False), self.weights(gate, up, down))

    def accumulation(self) -> float:
        """The kernel's accumulation error for the scheme (what the reference's slack prices)."""
        return self.kernel.accumulation(self.scheme)
