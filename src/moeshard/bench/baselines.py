"""What the expert kernels are compared with, on the same routed rows.

* ``grouped_mm``: the two ``torch._grouped_mm`` GEMMs alone, on rows already sorted by expert
  (the sort, gather, activation and unpermute are not counted): the strictest bf16 baseline.
* ``portable``: ``GroupedExperts``, the whole portable pipeline (sort, gather,
  ``torch._grouped_mm``, activation in fp32, unpermute).
* ``loop``: one plain matmul pair per active expert from Python (timed eagerly: host launch
  overhead is what such code pays).
* ``scaled_grouped_mm``: fp8 with per-row and per-channel scales through
  ``torch._scaled_grouped_mm`` (GEMMs only), where this torch build supports it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from moeshard.experts.base import ExpertInput, ExpertWeights
from moeshard.experts.grouped import activate, group_sizes
from moeshard.quant import QuantizedActivations, quantize_activations


def sorted_rows(inp: ExpertInput, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """(rows sorted by expert [M, H] in the model dtype, int32 cumulative offsets [E], counts).

    Routed row m is x[m // inp.repeat]; the gather materialises the M rows (outside timing).
    """
    x = inp.x.dequantize(torch.bfloat16) if isinstance(inp.x, QuantizedActivations) else inp.x
    order = torch.argsort(inp.expert_ids, stable=True)
    counts = group_sizes(inp.expert_ids, num_experts)
    return x[order // inp.repeat].contiguous(), torch.cumsum(counts, 0).to(torch.int32), counts.tolist()


def _plain(experts: ExpertWeights, where: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate_up, down) of unquantized experts; the bf16 baselines run on nothing else."""
    gate_up, down = experts.gate_up, experts.down
    if not isinstance(gate_up, torch.Tensor) or not isinstance(down, torch.Tensor):
        raise ValueError(f"{where}: experts must be unquantized tensors (scheme 'none'), got scheme {experts.scheme!r}")
    return gate_up, down


def grouped_mm(x_sorted: torch.Tensor, offsets: torch.Tensor, experts: ExpertWeights) -> Callable[[], object]:
    """Both projections through ``torch._grouped_mm``; h is a fixed random [M, I] input."""
    h = torch.randn(x_sorted.shape[0], experts.intermediate_size, device=x_sorted.device).to(x_sorted.dtype)
    gate_up, down = _plain(experts, "grouped_mm")
    w13 = gate_up.transpose(-2, -1)
    w2 = down.transpose(-2, -1)
    return lambda: (torch._grouped_mm(x_sorted, w13, offs=offsets), torch._grouped_mm(h, w2, offs=offsets))


def per_expert_loop(x_sorted: torch.Tensor, counts: list[int], experts: ExpertWeights,
                    activation: str) -> Callable[[], object]:
    """gate_up, act(gate) * up, down for each expert's contiguous rows, from Python."""
    gate_up, down = _plain(experts, "per_expert_loop")
    y = torch.empty(x_sorted.shape[0], experts.hidden_size, dtype=x_sorted.dtype, device=x_sorted.device)
    bounds, start = [], 0
    for e, c in enumerate(counts):
        if c:
            bounds.append((e, start, start + c))
        start += c

    def run():
        for e, lo, hi in bounds:
            h = activate(x_sorted[lo:hi] @ gate_up[e].T, activation, x_sorted.dtype)
            y[lo:hi] = h @ down[e].T
        return y
    return run


def scaled_grouped_mm(x_sorted: torch.Tensor, offsets: torch.Tensor, experts: ExpertWeights) -> Callable[[], object] | None:
    """fp8 row-scaled GEMMs (fp8_token / fp8_tensor weights), or None where unsupported here."""
    if not hasattr(torch, "_scaled_grouped_mm") or experts.scheme not in ("fp8_tensor", "fp8_token"):
        return None
    E = experts.num_experts
    xq = quantize_activations(x_sorted, "fp8_token")
    h = torch.randn(x_sorted.shape[0], experts.intermediate_size, device=x_sorted.device)
    hq = quantize_activations(h, "fp8_token")

    def channel_scales(w):
        return w.scale if w.scheme == "fp8_token" else w.scale[:, None].expand(E, w.shape[1]).contiguous()

    s13, s2 = channel_scales(experts.gate_up), channel_scales(experts.down)
    w13, w2 = experts.gate_up.data.transpose(-2, -1), experts.down.data.transpose(-2, -1)
    assert xq.row_scale is not None and hq.row_scale is not None  # fp8_token scales every row
    sa, sh = xq.row_scale.reshape(-1), hq.row_scale.reshape(-1)

    def run():
        return (torch._scaled_grouped_mm(xq.data, w13, sa, s13, offs=offsets, out_dtype=torch.bfloat16),
                torch._scaled_grouped_mm(hq.data, w2, sh, s2, offs=offsets, out_dtype=torch.bfloat16))
    try:
        run()
        torch.cuda.synchronize()
    except (RuntimeError, TypeError, NotImplementedError):
        return None
    return run
