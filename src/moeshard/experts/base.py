"""What an expert kernel receives and holds.

Shapes: M routed rows (copies of tokens, one per (token, k) pair this rank computes; see
``ExpertInput.repeat`` for copies that are not materialised),
H hidden, E_l local experts, I_l local intermediate size (I / tp under tensor parallelism).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moeshard.quant import QuantizedActivations, QuantizedWeight

Weight = torch.Tensor | QuantizedWeight


@dataclass(frozen=True)
class ExpertWeights:
    """This rank's routed experts.

    gate_up: [E_l, 2 * I_l, H]; rows [0, I_l) are this rank's gate slice, [I_l, 2 I_l) its up slice.
    down:    [E_l, H, I_l].
    Both are model-dtype tensors (scheme "none") or ``QuantizedWeight`` of ``scheme``.
    """

    gate_up: Weight
    down: Weight
    scheme: str = "none"

    @property
    def num_experts(self) -> int:
        return self.gate_up.shape[0]

    @property
    def intermediate_size(self) -> int:
        return self.down.shape[2]

    @property
    def hidden_size(self) -> int:
        return self.down.shape[1]

    def to(self, device) -> "ExpertWeights":
        return ExpertWeights(self.gate_up.to(device), self.down.to(device), self.scheme)


@dataclass(frozen=True)
class ExpertInput:
    """Rows to run through the local experts: M routed rows.

    x: [M / repeat, H] in the model dtype (scheme "none", or ``defer_input_quant``: the experts
       quantize), or ``QuantizedActivations`` of that many rows, quantized before dispatch.
    expert_ids: int64 [M], local expert index in [0, E_l) of each routed row; rows need not be sorted.
    input_amax: fp32 [] or None. For per-tensor activation scales (fp8_tensor, nvfp4) under
       ``defer_input_quant``: the amax of the layer's whole input, identical on every rank of the
       quantization domain, so that deferred and early quantization agree bit for bit.
    repeat: x holds one row per ``repeat`` consecutive routed rows: routed row m is x[m // repeat]
       (its scales likewise). The ``local`` backend passes top-k, so a token's K routed copies are
       never materialised; the kernels gather through m // repeat instead. Outputs still have M rows.
    """

    x: torch.Tensor | QuantizedActivations
    expert_ids: torch.Tensor
    input_amax: torch.Tensor | None = None
    repeat: int = 1

    def __post_init__(self) -> None:
        # Shapes only: nothing here reads a device value, so construction stays graph-capturable.
        if not isinstance(self.repeat, int) or isinstance(self.repeat, bool) or self.repeat < 1:
            raise ValueError(f"ExpertInput.repeat: expected an int >= 1, got {self.repeat!r}")
        m, rows = self.expert_ids.shape[0], self.x.shape[0]
        if rows * self.repeat != m:
            raise ValueError(f"ExpertInput: x has {rows} rows and repeat={self.repeat}, so it describes "
                             f"{rows * self.repeat} routed rows, but expert_ids has {m}; x needs M / repeat = "
                             f"{m / self.repeat:g} rows")

    @property
    def num_rows(self) -> int:
        """M, the number of routed rows (and of output rows)."""
        return self.expert_ids.shape[0]
