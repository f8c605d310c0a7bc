"""The gradient reference: one device, fp64, autograd through a plain loop over experts.

    L = sum over rows t counted of <upstream[t], layer(x)[t]>

for the whole layer on one device: router (+ its bias) -> top-k -> each routed row through its
expert (fp64 GEMMs, the activation in fp64, + the expert biases) -> weighted sum (or, with the
weights on the input, each expert's input weighted and its output summed) -> + shared experts
(their gate, ``shared_scale``). The weights are those the layer holds (rounded to the model
dtype, the router in its stored precision), widened to fp64 leaves; x likewise: every parameter
the layer trains has a leaf here, the correction bias (a buffer) none. The router's logits have
the value the layer's have (``MoEConfig.router_dtype``: an fp32 product, or the model-dtype
product, whose rounding the gradient passes straight through), so the reference picks exactly
the experts the layer picks and differentiates the same fp32 routing function of them;
everything after it is fp64.

Rounding: the layer rounds some forward values to the model dtype (the experts' gate_up
products and their sums with the biases, h and their outputs, each TP slice's output on its own,
the weighted inputs; the shared experts compute in the model dtype). The reference rounds the
same values the same way and passes the gradient straight through each rounding in
fp64 (``_rounded``), so it differentiates the function the layer computes, at the points the
layer evaluates it: an activation's derivative near its zero crossing (SiLU's at -1.28) would
otherwise differ by far more than the model dtype's precision.

The gradients returned are those a layout must produce after ``reduce_gradients`` (op "sum"):
of every token's row of x, of every parameter whole (a rank compares its shard), and of the
top-k weights; ``shard_of_grad`` cuts a rank's shard out of a whole parameter's gradient.
``rows`` restricts the loss to some token rows: what one rank's own backward contributes
before any reduction (``moeshard check --explain``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moeshard.config import MoEConfig
from moeshard.router import router_logits, select_experts
from moeshard.sharding import ShardSpec
from moeshard.weights import MoEWeights

# Buffers, not parameters: no gradient reaches them (a correction bias is updated by its own rule).
NOT_TRAINED = ("gate.e_score_correction_bias",)


@dataclass(frozen=True)
class GradReference:
    """x: fp64 [N, H] dL/dx; params: fp64 dL/d(parameter) of the whole layer under the layer's
    parameter names (``MoEWeights.state_dict`` keys: ``gate.weight``, ``experts.gate_up_proj``
    [E, 2I, H], ...); topk_weights: fp64 [N, K] dL/d(top-k weight); topk_ids: int64 [N, K] the
    experts chosen; norm: the 2-norm over every parameter's gradient."""

    x: torch.Tensor
    params: dict[str, torch.Tensor]
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor

    @property
    def norm(self) -> float:
        return math.sqrt(sum(float(g.pow(2).sum()) for g in self.params.values()))


def _rounded(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t (fp64) with the value rounded to ``dtype`` and the gradient passed straight through."""
    return t + (t.to(dtype).double() - t).detach()


def _rounded_activation(act, gate: torch.Tensor, up: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """act(gate, up) as the model dtype computes it: h's value is the kind run in ``dtype`` on
    the (rounded) inputs, the gradient is the fp64 kind's at those inputs."""
    exact = act(gate, up)
    with torch.no_grad():
        value = act(gate.to(dtype), up.to(dtype)).double()
    return exact + (value - exact).detach()


def _expert(rows: torch.Tensor, e: int, leaves: dict[str, torch.Tensor], cfg: MoEConfig,
            intermediate_shards: int) -> torch.Tensor:
    """fp64 [R, H]: rows [R, H] (fp64, model-dtype values) through routed expert e, unweighted, as
    ``GroupedExperts`` rounds: the GEMM outputs, the gate_up bias added to the rounded product
    and rounded again, h (computed in fp32: exact here), each TP slice's down product on its own
    and the down bias added once, to TP rank 0's (the slice whose rank holds it)."""
    dtype, act = cfg.dtype, cfg.activation_kind
    gate_up = _rounded(rows @ leaves["experts.gate_up_proj"][e].T, dtype)
    if "experts.gate_up_proj_bias" in leaves:
        gate_up = _rounded(gate_up + leaves["experts.gate_up_proj_bias"][e], dtype)
    h = _rounded(act.apply(gate_up), dtype)  # gate and up columns, or up's alone (ungated)
    down = leaves["experts.down_proj"][e]
    parts = []
    for s, (h_s, d_s) in enumerate(zip(h.chunk(intermediate_shards, dim=1), down.chunk(intermediate_shards, dim=1),
                                       strict=True)):
        part = _rounded(h_s @ d_s.T, dtype)
        if s == 0 and "experts.down_proj_bias" in leaves:
            part = _rounded(part + leaves["experts.down_proj_bias"][e], dtype)
        parts.append(part)
    return torch.stack(parts).sum(dim=0)


def _shared(x64: torch.Tensor, leaves: dict[str, torch.Tensor], cfg: MoEConfig) -> torch.Tensor:
    """fp64 [N, H]: the shared experts as ``SharedExperts`` and the layer round them (model-dtype
    linears and activation, each op rounds), times their gate and ``shared_scale``."""
    dtype, act = cfg.dtype, cfg.shared_activation_kind
    gate = _rounded(x64 @ leaves["shared_experts.gate_proj.weight"].T, dtype)
    up = _rounded(x64 @ leaves["shared_experts.up_proj.weight"].T, dtype)
    shared = _rounded(_rounded_activation(act, gate, up, dtype) @ leaves["shared_experts.down_proj.weight"].T, dtype)
    if "shared_expert_gate.weight" in leaves:
        score = _rounded(torch.sigmoid(_rounded(x64 @ leaves["shared_expert_gate.weight"].T, dtype)), dtype)
        shared = _rounded(score * shared, dtype)
    if cfg.shared_scale != 1.0:
        shared = _rounded(shared * cfg.shared_scale, dtype)
    return shared


def _logits(x: torch.Tensor, x64: torch.Tensor, gate: torch.Tensor, gate64: torch.Tensor, cfg: MoEConfig,
            bias: torch.Tensor | None, bias64: torch.Tensor | None) -> torch.Tensor:
    """fp32 router logits [N, E] whose value is the layer's and whose gradient reaches the fp64
    leaves x64 [N, H], gate64 [E, H] and the router bias bias64 [E] (or None): with
    ``router_dtype="fp32"`` the fp32 product itself; with ``"model"`` the model-dtype product the
    layer computes (``router_logits`` on x and the held gate and bias), with the gradient passed
    straight through its rounding as ``_rounded`` does."""
    if cfg.router_dtype == "fp32":
        return F.linear(x64.float(), gate64.float(), None if bias64 is None else bias64.float())
    exact = F.linear(x64, gate64, bias64)
    with torch.no_grad():
        value = router_logits(x.cpu(), gate, cfg.router_dtype, bias).double()
    return (exact + (value - exact).detach()).float()


def reference_grads(x: torch.Tensor, upstream: torch.Tensor, weights: MoEWeights, cfg: MoEConfig,
                    rows: torch.Tensor | None = None, intermediate_shards: int = 1) -> GradReference:
    """x: [N, H] the tokens (the model dtype); upstream: [N, H] dL/d(output) of each row; weights:
    the full weights (any device, CPU results); rows: bool [N], the rows whose loss counts (None:
    all); intermediate_shards: the TP slices of I whose down products the layer rounds each on
    its own (tp under TP without EP, else 1).

    Every part a family brings is computed as the layer computes it, so that its gradient is
    compared too: the router bias (added to the fp32 logits), the weights on the input (each
    (token, k) pair a row ``x * w`` of its own, both rounded as ``router.weighted_rows`` rounds
    them, through its expert unweighted, a token's K rows summed), the expert biases and
    ``shared_scale``."""
    if x.dim() != 2 or x.shape[1] != cfg.hidden_size or upstream.shape != x.shape:
        raise ValueError(f"reference_grads: x and upstream must both be [N, hidden_size={cfg.hidden_size}], got "
                         f"{tuple(x.shape)} and {tuple(upstream.shape)}")
    held = weights.to(device="cpu", dtype=cfg.dtype)  # what the layer holds (the router keeps its precision)
    leaves = {name: t.double().requires_grad_() for name, t in held.state_dict().items() if name not in NOT_TRAINED}
    x64 = x.cpu().double().requires_grad_()
    bias = None if held.correction_bias is None else held.correction_bias.float()
    # The router bias is inside the product, as the layer's router_logits adds it.
    routing = select_experts(_logits(x, x64, held.router_weight, leaves["gate.weight"], cfg, held.gate_bias,
                                     leaves.get("gate.bias")), cfg, bias)
    dtype = cfg.dtype
    N, K = routing.topk_ids.shape
    if cfg.routing_kind.weights_on_input:
        w_in = _rounded(routing.topk_weights.double(), dtype)  # the weight rounded first, then the product
        inputs = _rounded(x64.unsqueeze(1) * w_in.unsqueeze(-1), dtype).reshape(N * K, cfg.hidden_size)
        ids, w = routing.topk_ids.reshape(N * K, 1), torch.ones(N * K, 1, dtype=torch.float64)
    else:
        inputs, ids, w = x64, routing.topk_ids, routing.topk_weights.double()
    out = torch.zeros(inputs.shape[0], cfg.hidden_size, dtype=torch.float64)
    for e in range(cfg.num_experts):
        tok, k = (ids == e).nonzero(as_tuple=True)
        if tok.numel():
            y = _expert(inputs[tok], e, leaves, cfg, intermediate_shards)
            out = out.index_add(0, tok, y * w[tok, k].unsqueeze(1))
    if cfg.routing_kind.weights_on_input:
        out = out.view(N, K, cfg.hidden_size).sum(dim=1)
    if cfg.has_shared_experts:
        out = out + _shared(x64, leaves, cfg)
    g = upstream.cpu().double()
    if rows is not None:
        g = g * rows.cpu().double().unsqueeze(1)
    names = list(leaves)
    loss = (out * g).sum()
    wrt = [x64, routing.topk_weights, *leaves.values()]
    # No token reaches an expert and no shared experts (an empty batch): every gradient is zero.
    grads = torch.autograd.grad(loss, wrt, allow_unused=True) if loss.requires_grad else [None] * len(wrt)
    params = {n: torch.zeros_like(leaves[n]) if gr is None else gr for n, gr in zip(names, grads[2:], strict=True)}
    gx = torch.zeros_like(x64) if grads[0] is None else grads[0]
    gw = torch.zeros_like(routing.topk_weights, dtype=torch.float64) if grads[1] is None else grads[1].double()
    return GradReference(gx, params, gw, routing.topk_ids)


def shard_of_grad(name: str, full: torch.Tensor, spec: ShardSpec, cfg: MoEConfig) -> torch.Tensor:
    """The part of a whole parameter's gradient ``full`` that a rank with ``spec`` holds: its
    experts of ``experts.*`` (TP: its slice of I, gate and up halves of ``gate_up*``, the last
    dim of a 3-d ``down*``), anything else whole."""
    if not name.startswith("experts."):
        return full
    part = full[list(spec.logical_experts)]
    if spec.tp_size > 1:
        I = cfg.intermediate_size
        w = I // spec.tp_size
        lo, hi = spec.tp_rank * w, (spec.tp_rank + 1) * w
        if name.startswith("experts.gate_up"):
            part = torch.cat([part[:, r] for r in cfg.activation_kind.gate_up_rows(lo, hi, I)], dim=1)
        elif name.startswith("experts.down") and part.dim() == 3:
            part = part[..., lo:hi]
    return part
