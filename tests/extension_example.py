"""A test-only quantization scheme and a test-only dispatch backend, added the way CONTRIBUTING.md
says: a codec plus one ``register_scheme`` entry, a backend class plus one ``register_backend``
entry. Nothing else in the package is touched (no table, no if/elif chain, no kernel): that is
what tests/test_extension.py proves by running them through the layer, the reference and the
verification harness.

* ``int8_token``: int8 with one fp32 scale per output channel (weights) and per row
  (activations), ``scale = amax / 127``, round to nearest even. No Triton kernel mode, so it
  runs on the portable experts everywhere.
* ``local_blocks``: no expert parallelism; hands the experts one padded block of T rows per
  expert (the ``EXPERT_BLOCKS`` layout), the first ``counts[e]`` of them valid.

Registration is explicit and idempotent (``ensure_registered``), and undone by ``unregister``,
so that other tests' default matrices do not change. ``layer`` is the harness's layer factory:
spawned ranks import this module through it and register there too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moeshard.dispatch.base import Dispatched, RowBackend, weighted_sum
from moeshard.dispatch.registry import BACKENDS, BackendSpec, register_backend, unregister_backend
from moeshard.experts.base import EXPERT_BLOCKS
from moeshard.experts.grouped import group_sizes
from moeshard.layer import MoELayer
from moeshard.quant import Codec, QuantScheme, register_scheme, scheme_names, unregister_scheme
from moeshard.quant.fp8 import AMAX_FLOOR, abs_amax
from moeshard.router import Routing

INT8_MAX = 127.0


def _scale(amax: torch.Tensor) -> torch.Tensor:
    amax = amax.float().clamp_min(AMAX_FLOOR)
    return amax / torch.full((), INT8_MAX, device=amax.device)


def _q(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return torch.round(x.float() / scale).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)


class Int8Token(Codec):
    data_dtype = torch.int8
    whole_expert_scale = True  # down's per-row scale spans all of I
    row_scale_dtype = torch.float32

    def weight_scale_shape(self, e, n, k):
        return (e, n)

    def quantize_weight(self, w):
        scale = _scale(abs_amax(w, (2,)))
        return _q(w, scale[:, :, None]), scale, None

    def dequantize_weight(self, data, scale, glob, shape):
        return data.float() * scale[:, :, None]

    def row_scale_shape(self, m, k):
        return (m, 1)

    def quantize_activations(self, x, tensor_amax, source):
        scale = _scale(abs_amax(source, (1,), keepdim=True))
        return _q(x, scale), scale, None

    def dequantize_activations(self, data, row_scale, tensor_scale, shape):
        return data.float() * row_scale


@dataclass(frozen=True)
class BlocksState:
    """slot: int64 [T*K] block row of each (token, k) pair; token: int64 [T*K] its token;
    weights: fp32 [T*K]; num_tokens: T."""

    slot: torch.Tensor
    token: torch.Tensor
    weights: torch.Tensor
    num_tokens: int


class LocalBlocksBackend(RowBackend):
    """No EP: expert e's rows are rows [e*T, (e+1)*T) of the experts' input (an expert is routed
    at most once per token, so T rows always suffice), padding rows have expert id -1."""

    name = "local_blocks"

    def dispatch(self, x: torch.Tensor, routing: Routing) -> Dispatched:
        T, K = routing.topk_ids.shape
        E = self.cfg.num_experts
        p = self.payload(x)
        flat = routing.topk_ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = group_sizes(flat, E)
        starts = torch.cumsum(counts, 0) - counts
        expert = flat[order]
        slot = expert * T + torch.arange(T * K) - starts[expert]
        token = torch.div(order, K, rounding_mode="floor")
        rows = p.rows.new_zeros((E * T, p.rows.shape[1]))
        rows[slot] = p.rows[token]
        scale = None
        if p.row_scale is not None:
            scale = p.row_scale.new_zeros((E * T, p.row_scale.shape[1]))
            scale[slot] = p.row_scale[token]
        ids = torch.full((E * T,), -1, dtype=torch.int64)
        ids[slot] = expert
        inp = p.expert_input(rows, scale, ids, block_counts=counts)
        return Dispatched(inp, BlocksState(slot, token, routing.topk_weights.reshape(-1)[order].float(), T))

    def combine(self, y: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        s = dispatched.state
        return weighted_sum(y[s.slot], s.weights, s.token, s.num_tokens)


SCHEME = QuantScheme("int8_token", Int8Token(), None, 0.05, "int8; scale per output channel / per row")
BACKEND = BackendSpec("local_blocks", "no_ep", EXPERT_BLOCKS, True, (), "test only: one padded block per expert",
                      LocalBlocksBackend)


def ensure_registered() -> None:
    if SCHEME.name not in scheme_names():
        register_scheme(SCHEME)
    if BACKEND.name not in BACKENDS:
        register_backend(BACKEND)


def unregister() -> None:
    unregister_scheme(SCHEME.name)
    unregister_backend(BACKEND.name)


def layer(*args, **kwargs) -> MoELayer:
    """The harness's layer factory: registers the extensions (in a spawned rank too), then builds
    the plain ``MoELayer``."""
    ensure_registered()
    return MoELayer(*args, **kwargs)
