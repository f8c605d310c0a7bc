"""Empty picks: a routing given to ``MoEExperts`` with zero-computation experts (LongCat-Flash)
reaches the layer with id -1 for those picks (``Routing.empty_picks``). No expert computes such a
pick, no link carries it, and it adds nothing to its token's output; the zero-computation term
(weight * row) is added after the layer. Before empty picks, such a pick went through the layer as
expert 0 with weight 0: at LongCat-Flash's about one pick in three, expert 0 (and under EP its
rank) took several rows per token that nothing used.

The definition here is hand-written torch (a loop over the picks, float32), with autograd for the
gradients of the rows and of the given weights; every layout and EP backend must give it.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from moeshard.parallel.config import ParallelConfig
from moeshard.parallel.spawn import spawn

E, Z, K, T = 8, 2, 3, 7


def _inputs(dp_rank: int, hidden: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, H], ids [T, K] distinct per token in [0, E + Z) (a token of zero-computation picks
    only, one with none), weights [T, K] in (0, 1]: this DP rank's tokens."""
    gen = torch.Generator().manual_seed(10 + dp_rank)
    x = torch.randn(T, hidden, generator=gen)
    ids = torch.stack([torch.randperm(E + Z, generator=gen)[:K] for _ in range(T)])
    ids[0] = torch.tensor([E, E + 1, 3])
    ids[1] = torch.tensor([E + 1, 5, E])
    ids[2] = torch.tensor([0, 1, 2])
    ids[3, :2] = torch.tensor([E, E + 1])
    ids[3, 2] = 0
    ids[4] = torch.tensor([E, 0, E + 1])
    weights = torch.rand(T, K, generator=gen) * 0.9 + 0.1
    return x, ids, weights


def _definition(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                down: torch.Tensor) -> torch.Tensor:
    """sum over k of w * expert(x) for a routed pick (silu(gate) * up, then down), w * x for a
    zero-computation one (id >= E)."""
    out = []
    for t in range(x.shape[0]):
        row = torch.zeros_like(x[t])
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            if e >= E:
                row = row + weights[t, k] * x[t]
            else:
                gate, up = (gate_up[e] @ x[t]).chunk(2)
                row = row + weights[t, k] * (down[e] @ (F.silu(gate) * up))
        out.append(row)
    return torch.stack(out)


def _run(layer, x, ids, weights, grad_out):
    """(output, dL/dx, dL/dweights) of the layer for L = sum(output * grad_out)."""
    x = x.clone().requires_grad_(True)
    weights = weights.clone().requires_grad_(True)
    out = layer(x, ids, weights)
    (out * grad_out).sum().backward()
    return out.detach(), x.grad, weights.grad


def test_an_empty_pick_is_computed_by_no_expert_and_adds_nothing():
    """One rank, float32: the layer's output and the gradients of its rows, of the given weights
    and of the experts equal the definition, and the experts are handed no row of an empty pick
    but as padding (id -1). A kernel that leaves those rows NaN, as the Triton kernels leave them
    unwritten, still gives the definition: the local backend's combine skips them
    (``BackendSpec.combine_skips_empty``), and the layer hands them on unzeroed, saving a pass
    over the experts' output; a backend without the flag gets them zeroed by the layer."""
    from moeshard.integrations.given_routing import MoEExperts
    from moeshard.presets import PRESETS
    from moeshard.weights import MoEWeights

    cfg = dataclasses.replace(PRESETS["mixtral-8x7b"].config("small", torch.float32), top_k=K)
    full = MoEWeights.random(cfg, generator=torch.Generator().manual_seed(0))
    layer = MoEExperts(cfg, weights=full, identity_experts=Z).requires_grad_(True)
    x, ids, weights = _inputs(0, cfg.hidden_size)
    grad_out = torch.randn(T, cfg.hidden_size, generator=torch.Generator().manual_seed(5))

    out, dx, dw = _run(layer, x, ids, weights, grad_out)
    routed = ids < E
    assert layer.expert_loads().tolist() == torch.bincount(ids[routed], minlength=E).tolist()  # routed picks only

    seen = []
    kernel = layer.kernel

    def poisoning(inp, w):
        seen.append(inp.expert_ids.clone())
        y = kernel(inp, w)
        return y.masked_fill((inp.expert_ids < 0).unsqueeze(1), float("nan"))

    layer.kernel = poisoning  # forward only, as the Triton kernels (a backward runs the portable experts)
    combined = []
    combine_final = layer.backend.combine_final

    def watching(y, *args):
        combined.append(int(y.isnan().any(dim=1).sum()))
        return combine_final(y, *args)

    layer.backend.combine_final = watching  # the layer reads the method at each forward
    with torch.no_grad():
        poisoned = layer(x, ids, weights)
    del layer.backend.combine_final
    assert torch.equal(seen[0], torch.where(routed, ids, -1).reshape(-1))  # local: token-major pairs
    assert combined == [int((~routed).sum())]  # the empty picks' rows reached the combine as the kernel left them
    torch.testing.assert_close(poisoned, out, rtol=0, atol=0)

    from moeshard.dispatch.registry import BACKENDS
    spec = BACKENDS["local"]
    BACKENDS["local"] = dataclasses.replace(spec, combine_skips_empty=False)
    combined.clear()
    try:
        layer.backend.combine_final = watching
        with torch.no_grad():
            zeroed = layer(x, ids, weights)
    finally:
        BACKENDS["local"] = spec
        del layer.backend.combine_final
    layer.kernel = kernel
    assert combined == [0]  # a combine that weighs every row gets them as zeros
    torch.testing.assert_close(zeroed, out, rtol=0, atol=0)

    xr, wr = x.clone().requires_grad_(True), weights.clone().requires_grad_(True)
    gate_up = full.gate_up.clone().requires_grad_(True)
    down = full.down.clone().requires_grad_(True)
    want = _definition(xr, ids, wr, gate_up, down)
    (want * grad_out).sum().backward()
    torch.testing.assert_close(out, want.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dx, xr.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dw, wr.grad, rtol=1e-5, atol=1e-5)
    params = dict(layer.named_parameters())
    torch.testing.assert_close(params["experts.gate_up_proj"].grad, gate_up.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(params["experts.down_proj"].grad, down.grad, rtol=1e-5, atol=1e-5)


# (dp, tp, EP, backend, placement slots or None); the replicas: experts 0 and 1 on both ranks
REPLICAS = (0, 1, 2, 3, 4, 5, 6, 7, 0, 1)
LAYOUTS = [(1, 2, False, "local", None), (1, 2, True, "all2all", None), (2, 1, True, "all2all", None),
           (2, 1, True, "allgather_reducescatter", None), (2, 1, True, "low_latency", None),
           (2, 1, True, "all2all", REPLICAS), (2, 1, True, "low_latency", REPLICAS)]


def _worker(layouts) -> list[str]:
    from moeshard.eplb.placement import Placement
    from moeshard.integrations.given_routing import MoEExperts
    from moeshard.parallel.groups import ParallelGroups
    from moeshard.presets import PRESETS
    from moeshard.weights import MoEWeights

    cfg = dataclasses.replace(PRESETS["mixtral-8x7b"].config("small", torch.float32), top_k=K)
    full = MoEWeights.random(cfg, generator=torch.Generator().manual_seed(0))
    failures = []
    for dp, tp, ep, backend, slots in layouts:
        config = ParallelConfig(dp=dp, tp=tp, enable_ep=ep)
        groups = ParallelGroups.build(config)
        dp_rank = config.dp_rank(dist.get_rank())
        placement = None if slots is None else Placement(E, dp * tp, slots)
        layer = MoEExperts(cfg, weights=full, identity_experts=Z, groups=groups, backend=backend,
                           max_tokens_per_rank=T, placement=placement)
        x, ids, weights = _inputs(dp_rank, cfg.hidden_size)
        grad_out = torch.randn(T, cfg.hidden_size, generator=torch.Generator().manual_seed(5 + dp_rank))
        xr, wr = x.clone().requires_grad_(True), weights.clone().requires_grad_(True)
        want = _definition(xr, ids, wr, full.gate_up, full.down)
        (want * grad_out).sum().backward()
        name = f"{config.name} {backend}" + (" replicas" if slots else "")
        if placement is None:
            out, dx, dw = _run(layer, x, ids, weights, grad_out)
            pairs = [("output", out, want.detach()), ("dx", dx, xr.grad), ("dweights", dw, wr.grad)]
        else:  # a placement with replicas has no backward (the layer refuses it)
            with torch.no_grad():
                pairs = [("output", layer(x, ids, weights), want.detach())]
        for what, got, ref in pairs:
            if not torch.allclose(got, ref, rtol=1e-5, atol=1e-5):
                failures.append(f"{name} rank {dist.get_rank()}: {what} off by {(got - ref).abs().max():.3g}")
        routed = torch.bincount(ids[ids < E], minlength=E)
        loads = layer.expert_loads()
        total = routed.clone()
        dist.all_reduce(total)
        if dp == 1:
            total //= tp  # the TP ranks of a DP rank route the same tokens
        if not torch.equal(loads, total):
            failures.append(f"{name}: loads {loads.tolist()}, routed picks {total.tolist()}")
        # Forward: a kernel that leaves the empty picks' rows NaN (as the Triton kernels leave them
        # unwritten); every built-in backend's combine skips them, so the layer hands them on.
        kernel = layer.kernel
        layer.kernel = lambda inp, w, kernel=kernel: kernel(inp, w).masked_fill((inp.expert_ids < 0).unsqueeze(1),
                                                                                float("nan"))
        with torch.no_grad():
            poisoned = layer(x, ids, weights)
        if not torch.allclose(poisoned, want.detach(), rtol=1e-5, atol=1e-5):
            failures.append(f"{name} rank {dist.get_rank()}: the output with the empty picks' rows NaN off by "
                            f"{(poisoned - want).abs().max():.3g}")
        del layer, groups
    return failures


def test_every_layout_and_ep_backend_gives_the_definition():
    """Two ranks: TP, SP (EP with TP), and EP on each backend, with replicas too (forward only:
    a placement with replicas has no backward); each rank's output and gradients as the
    definition's for its DP rank's tokens, also where the experts leave the empty picks' rows
    NaN; the loads the routed picks only."""
    per_rank = spawn(_worker, 2, args=(LAYOUTS,), timeout_s=240, preload=("moeshard.layer",))
    assert per_rank == [[], []], per_rank


def test_a_flag_that_is_not_a_bool_is_refused_by_name():
    from moeshard.integrations.given_routing import MoEExperts
    from moeshard.layer import MoELayer
    from moeshard.presets import PRESETS

    cfg = PRESETS["mixtral-8x7b"].config("small")
    with pytest.raises(ValueError, match=r"MoELayer \(rank 0\): empty_picks must be a bool, got 'yes'"):
        MoELayer(cfg, empty_picks="yes")
    with pytest.raises(ValueError, match=r"MoEExperts \(layer 3\): zero_weight_skips must be a bool, got 1"):
        MoEExperts(cfg, layer=3, zero_weight_skips=1)
