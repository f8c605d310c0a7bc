"""What an expert kernel receives and holds, and what every kernel computes.

Shapes: M routed rows (copies of tokens, one per (token, k) pair this rank computes; see
``ExpertInput.repeat`` for copies that are not materialised), H hidden, E_l local experts, I_l
local intermediate size (I / tp under tensor parallelism), C rows per expert block.

Row layouts (``ExpertInput.layout``), what a dispatch backend hands over and a kernel declares it
accepts (``ExpertKernel.layouts``; ``moeshard.dispatch.registry.support`` checks the pair):

* ``FLAT``: M rows in any order; ``expert_ids[m]`` is row m's local expert, or -1 for a padding
  row that no expert computes (fixed-capacity backends pad their buffers).
* ``EXPERT_BLOCKS``: one padded block of C rows per local expert (rows ``[e*C, (e+1)*C)``), the
  first ``block_counts[e]`` of them valid. ``expert_ids`` is given too (e for valid rows, -1 for
  padding), so a flat kernel can run it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from moeshard.activations import get_activation
from moeshard.quant import QuantizedActivations, QuantizedWeight

Weight = torch.Tensor | QuantizedWeight

FLAT = "flat"
EXPERT_BLOCKS = "expert_blocks"
LAYOUTS = (FLAT, EXPERT_BLOCKS)


def activate(gate_up: torch.Tensor, activation: str, out_dtype: torch.dtype) -> torch.Tensor:
    """gate_up: [M, 2 I] (gate rows' products in columns [0, I), up's in [I, 2I)), or for an
    ungated kind [M, I] (up's) -> h = act(gate, up) (ungated: act(up)) of the registered kind
    ``activation`` (``moeshard.activations``), computed in fp32, rounded to ``out_dtype``: [M, I].

    The one definition of the activation: the portable experts, the reference and (in
    registers) the Triton GEMM epilogue compute exactly this."""
    return get_activation(activation).apply(gate_up.float()).to(out_dtype)


@dataclass(frozen=True)
class ExpertWeights:
    """This rank's routed experts.

    gate_up: [E_l, 2 * I_l, H]; rows [0, I_l) are this rank's gate slice, [I_l, 2 I_l) its up slice;
      for an ungated activation (``ActivationKind.gated`` False) [E_l, I_l, H], its up slice alone.
    down:    [E_l, H, I_l].
    Both are model-dtype tensors (scheme "none") or ``QuantizedWeight`` of ``scheme``.
    gate_up_bias: None, or the model-dtype bias [E_l, 2 I_l] ([E_l, I_l] ungated) of gate_up's
      outputs (gate slice, then up slice, as gate_up's rows), added to the rounded product before the activation.
    down_bias: None, or the model-dtype bias [E_l, H] of down's output. Under tensor parallelism
      only TP rank 0 holds it (the ranks' partial sums are all-reduced: it is added once).
    Biases are never quantized, whatever the scheme.
    """

    gate_up: Weight
    down: Weight
    scheme: str = "none"
    gate_up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None

    @property
    def num_experts(self) -> int:
        return self.gate_up.shape[0]

    @property
    def intermediate_size(self) -> int:
        return self.down.shape[2]

    @property
    def hidden_size(self) -> int:
        return self.down.shape[1]

    @property
    def has_bias(self) -> bool:
        """Whether any bias is held (a kernel without bias support must refuse these weights)."""
        return self.gate_up_bias is not None or self.down_bias is not None

    def to(self, device) -> ExpertWeights:
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return ExpertWeights(self.gate_up.to(device), self.down.to(device), self.scheme, move(self.gate_up_bias),
                             move(self.down_bias))


@dataclass(frozen=True)
class ExpertInput:
    """Rows to run through the local experts: M routed rows.

    x: [M / repeat, H] in the model dtype (scheme "none", or ``defer_input_quant``: the experts
       quantize), or ``QuantizedActivations`` of that many rows, quantized before dispatch.
    expert_ids: int64 [M], local expert index in [0, E_l) of each routed row, -1 for a padding
       row (no expert computes it; its output row is unspecified); rows need not be sorted.
    input_amax: fp32 [] or None. For per-tensor activation scales (fp8_tensor, nvfp4) under
       ``defer_input_quant``: the amax of the layer's whole input, identical on every rank of the
       quantization domain, so that deferred and early quantization agree bit for bit.
    repeat: x holds one row per ``repeat`` consecutive routed rows: routed row m is x[m // repeat]
       (its scales likewise). The ``local`` backend passes top-k, so a token's K routed copies are
       never materialised; the kernels gather through m // repeat instead. Outputs still have M rows.
    block_counts: ``EXPERT_BLOCKS`` layout only: int [E_l] valid rows of each expert's block of
       ``M // E_l`` rows (on the rows' device, never read back to the host). None: ``FLAT``.
    amax_reduce: None, or a function fp32 [E_l] -> fp32 [E_l] that a kernel must apply, exactly
       once per call (0 rows included: it may be collective), to the per-expert amax of h before
       it quantizes h with per-tensor scales (fp8_tensor, nvfp4). The layer sets it when
       replicas of one logical expert share its rows across ranks (expert-parallel load
       balancing): it all-reduces the amax over the replicas, so that h is quantized with the
       logical expert's scale, as on one device. Schemes without per-tensor scales ignore it.
    padded: False only where the sender guarantees that no id is -1 (the ``local`` backend: its
       ids are the routing's top-k); a training forward then skips masking padding rows.
    """

    x: torch.Tensor | QuantizedActivations
    expert_ids: torch.Tensor
    input_amax: torch.Tensor | None = None
    repeat: int = 1
    block_counts: torch.Tensor | None = None
    amax_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
    padded: bool = True

    def __post_init__(self) -> None:
        # Shapes only: nothing here reads a device value, so construction stays graph-capturable.
        if not isinstance(self.repeat, int) or isinstance(self.repeat, bool) or self.repeat < 1:
            raise ValueError(f"ExpertInput.repeat: expected an int >= 1, got {self.repeat!r}")
        m, rows = self.expert_ids.shape[0], self.x.shape[0]
        if rows * self.repeat != m:
            raise ValueError(f"ExpertInput: x has {rows} rows and repeat={self.repeat}, so it describes "
                             f"{rows * self.repeat} routed rows, but expert_ids has {m}; x needs M / repeat = "
                             f"{m / self.repeat:g} rows")
        if self.block_counts is not None:
            blocks = self.block_counts.shape[0] if self.block_counts.dim() == 1 else -1
            if blocks <= 0 or m % blocks or self.repeat != 1:
                raise ValueError(f"ExpertInput: block_counts of shape {list(self.block_counts.shape)} and "
                                 f"repeat={self.repeat} do not describe equal expert blocks of M={m} rows "
                                 f"(expected [E_l] with M % E_l == 0 and repeat 1)")

    @property
    def num_rows(self) -> int:
        """M, the number of routed rows (and of output rows), padding included."""
        return self.expert_ids.shape[0]

    @property
    def layout(self) -> str:
        return FLAT if self.block_counts is None else EXPERT_BLOCKS


class ExpertKernel(Protocol):
    """Computes routed experts; stateless, holds no weights.

    layouts: the ``ExpertInput`` layouts it accepts. ``accumulation(scheme)``: the relative
    accumulation error of its GEMM sums (a fraction of sum |a| |b|,
    ``moeshard.numerics.ACCUMULATION``), which the reference prices. ``__call__`` returns
    [M, H] in the model dtype: each routed row through its expert, unweighted, in input order.
    """

    layouts: tuple[str, ...]

    def accumulation(self, scheme: str) -> float: ...

    def __call__(self, inp: ExpertInput, weights: ExpertWeights) -> torch.Tensor: ...
