"""Tokens per logical expert, counted on the device over a running window of forwards.

    record(topk_ids [T, K])  -> counts [E] of this forward (fixed shape: one kernel whose last
                                program writes the row on CUDA, ``kernels.loads``; a scatter-add
                                elsewhere) written into row ``step % window`` of a ring [window, E]; step += 1
    read()                   -> int64 [E]: the sum of the ring (the last ``window`` forwards)

Everything stays on the device (the step counter too), so ``record`` never synchronises with
the host and a forward that records stays CUDA-graph capturable (a replay advances the window).
Reading, resetting and all-reducing over ranks happen on demand, outside the forward
(``MoELayer.expert_loads``, ``MoELayer.reset_expert_loads``).
"""

from __future__ import annotations

import torch
from torch import nn

from moeshard.triton_env import triton_importable
from moeshard.validate import positive_int


class LoadCounter(nn.Module):
    """Running window of per-expert token counts. num_experts: E; window: forwards kept."""

    # Buffers registered in __init__, declared so that type checkers see tensors, not Module attributes.
    ring: torch.Tensor
    step: torch.Tensor
    pending: torch.Tensor

    def __init__(self, num_experts: int, window: int, device: torch.device | str | None = None) -> None:
        super().__init__()
        positive_int("LoadCounter", "num_experts", num_experts)
        positive_int("LoadCounter", "window", window)
        self.num_experts, self.window = num_experts, window
        self.register_buffer("ring", torch.zeros(window, num_experts, dtype=torch.int64, device=device), persistent=False)
        self.register_buffer("step", torch.zeros(1, dtype=torch.int64, device=device), persistent=False)
        # The record kernel's programs add their counts and count themselves in here (zero again after
        # every record).
        self.register_buffer("pending", torch.zeros(num_experts + 1, dtype=torch.int32, device=device),
                             persistent=False)

    @torch.no_grad()
    def record(self, topk_ids: torch.Tensor) -> None:
        """topk_ids: int64 [T, K] logical expert ids of this forward's routed copies (T may be 0);
        an id of -1 is a copy that counts nowhere (a given pick of weight 0: ``MoEExperts``)."""
        ids = topk_ids.reshape(-1)
        if ids.is_cuda and triton_importable()[0]:
            from moeshard.kernels.loads import record_counts

            record_counts(ids, self.ring, self.step, self.pending)  # one launch: counts, then the row
            return
        counts = torch.zeros(self.num_experts, dtype=torch.int64, device=ids.device)
        counted = ids >= 0
        counts.scatter_add_(0, ids.clamp(min=0), counted.to(torch.int64))
        self.ring.index_copy_(0, torch.remainder(self.step, self.window), counts.unsqueeze(0))
        self.step.add_(1)

    def read(self) -> torch.Tensor:
        """int64 [E]: tokens routed to each expert over the window (this rank's routing only)."""
        return self.ring.sum(dim=0)

    @torch.no_grad()
    def reset(self) -> None:
        self.ring.zero_()
        self.step.zero_()
        self.pending.zero_()
