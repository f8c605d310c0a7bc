"""``local``: no expert parallelism; every rank holds every (possibly TP-sliced) expert.

Each (token, k) pair becomes one row, in token-major order: row ``t * K + k`` is token t's k-th
choice. No communication, and nothing here reads a value back to the host, so the single-device
forward stays CUDA-graph capturable.

Because rows are token-major, combine needs no scatter: ``out[t] = sum_k w[t, k] * y[t*K + k]``
is a strided reduction, done in one pass by a Triton kernel on CUDA (``moeshard.kernels.combine``)
and by a view-and-sum elsewhere. Both sum over k in order, in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moeshard.dispatch.base import Dispatched
from moeshard.kernels import triton_importable
from moeshard.router import Routing


@dataclass(frozen=True)
class LocalState:
    """topk_weights: fp32 [T, K] combine weights (row t*K + k of y carries weight [t, k])."""

    topk_weights: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return self.topk_weights.shape[0]


def _repeat_rows(t: torch.Tensor, k: int) -> torch.Tensor:
    """[T, C] -> [T * K, C], each row repeated K times in place (one copy kernel, no index)."""
    T = t.shape[0]
    return t.unsqueeze(1).expand(T, k, *t.shape[1:]).reshape(T * k, *t.shape[1:])


class LocalBackend:
    name = "local"

    def __init__(self, num_experts: int) -> None:
        self.num_experts = num_experts

    def dispatch(self, x: torch.Tensor, x_scale: torch.Tensor | None, routing: Routing) -> Dispatched:
        """x: [T, Hp]; x_scale: [T, S] or None; routing ids/weights [T, K] -> rows [T*K, Hp]."""
        T, K = routing.topk_ids.shape
        return Dispatched(
            x=_repeat_rows(x, K),
            x_scale=None if x_scale is None else _repeat_rows(x_scale, K),
            expert_ids=routing.topk_ids.reshape(-1),
            state=LocalState(routing.topk_weights.float().contiguous()),
        )

    def combine(self, y: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        """y: [T*K, H] expert outputs in dispatch order -> fp32 [T, H]."""
        w = dispatched.state.topk_weights
        T, K = w.shape
        if y.is_cuda and triton_importable()[0]:
            from moeshard.kernels.combine import combine_topk
            return combine_topk(y.contiguous(), w)
        return (y.reshape(T, K, y.shape[1]).float() * w.unsqueeze(-1)).sum(dim=1)
