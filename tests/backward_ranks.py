"""Rank functions of the backward tests (importable in spawned ranks: ``tests/`` is on their
``sys.path``), all run in one world of 2.

``gradchecks``: ``torch.autograd.gradcheck`` in fp64 of every custom Function, on every rank at
once. A distributed function has no Jacobian of its own on one rank, so each check is of a
*global* function F that every rank computes identically (the replicated loss of
``moeshard.autograd``): every rank holds the same global inputs, ``shard_rows`` hands each rank
its rows, the Function under test runs, ``gather_rows`` gives every rank every output. gradcheck
then perturbs the same element on every rank at once, which changes exactly one rank's input,
and seeds the same output element on every rank: its numerical and analytical Jacobians are F's.
A wrong backward anywhere in F (``shard_rows`` / ``gather_rows`` included: a summing gather
would make F's Jacobian 2x) fails on every rank. The per-rank work between them depends on the
rank, so a backward that mixed ranks up would fail too.

``training_steps``: a small whole model (a replicated linear, the MoE layer, a replicated
linear) under each layout of a world of 2: after ``reduce_gradients`` every parameter's
gradient (each rank's shard of the experts) and ``grad_norm`` equal one device's on all tokens.

``bias_updates``: a few steps of DeepSeek-V3's auxiliary-loss-free correction-bias update
(``update_correction_bias``) under EP, SP, TP and DP, the loads and biases of every step.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from moeshard.autograd import routed
from moeshard.autograd.collectives import gather_rows, shard_rows, tp_copy, tp_reduce
from moeshard.config import MoEConfig, QuantConfig
from moeshard.dispatch.base import BackendContext
from moeshard.dispatch.registry import BACKENDS, build_groups
from moeshard.experts.base import ExpertInput
from moeshard.layer import MoELayer
from moeshard.parallel.config import ParallelConfig
from moeshard.parallel.sequence import SequenceChunk
from moeshard.presets import PRESETS
from moeshard.router import Routing
from moeshard.training import clip_grad_norm_, grad_norm, reduce_gradients
from moeshard.training.reference import shard_of_grad
from moeshard.weights import MoEWeights

E, K, H = 4, 2, 2  # experts, top-k, hidden size of the gradient checks


def _toy_experts(inp: ExpertInput, scale: float = 1.0) -> torch.Tensor:
    """A smooth function of each routed row and its expert (padding rows: zero): y = scale *
    tanh(x * (1 + e))."""
    ids = inp.expert_ids
    x = inp.x
    assert isinstance(x, torch.Tensor)  # unquantized rows
    rows = x[torch.arange(ids.shape[0]) // inp.repeat]
    e = ids.clamp_min(0).to(rows.dtype).unsqueeze(1)
    return scale * torch.tanh(rows * (1 + e)) * (ids >= 0).to(rows.dtype).unsqueeze(1)


def _ids(n: int) -> torch.Tensor:
    """int64 [n, K]: distinct experts per token, spread over both ranks' experts."""
    t = torch.arange(n).unsqueeze(1)
    return (t + torch.arange(K) * (E // K + 1)) % E


def _check(fn, inputs) -> bool | str:
    try:
        return bool(torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-7, rtol=1e-5))
    except Exception as exc:  # noqa: BLE001 - the message is the test's evidence
        return f"{type(exc).__name__}: {str(exc)[:400]}"


def gradchecks() -> dict[str, bool | str]:
    """name -> True, or why gradcheck failed, on this rank."""
    torch.set_num_threads(1)
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(7)
    cfg = MoEConfig(num_experts=E, top_k=K, hidden_size=8, intermediate_size=16)
    ep = build_groups(ParallelConfig(2, 1, True), "cpu")
    tp = build_groups(ParallelConfig(1, 2, False), "cpu")
    results: dict[str, bool | str] = {}

    for sizes in ([2, 3], [0, 4]):
        x = torch.randn(sum(sizes), H, dtype=torch.float64, generator=gen, requires_grad=True)

        def rows(x, sizes=sizes):
            mine = shard_rows(x, sizes, rank, ep.ep_group, "ep")
            return gather_rows(mine * (rank + 1) + mine.sin(), sizes, rank, ep.ep_group, "ep")
        results[f"shard_rows/gather_rows {sizes}"] = _check(rows, (x,))

    x = torch.randn(3, H, dtype=torch.float64, generator=gen, requires_grad=True)
    w = torch.rand(3, K, dtype=torch.float64, generator=gen, requires_grad=True)

    def tp_pair(x, w):
        xc, wc = tp_copy(x, w, group=tp.tp_group)
        return tp_reduce(torch.sin(xc * (rank + 1)) * wc.sum(dim=1, keepdim=True), tp.tp_group)
    results["tp_copy/tp_reduce"] = _check(tp_pair, (x, w))

    def tp_local(x, w):  # the local backend under TP: each rank's experts a different "slice"
        backend = BACKENDS["local"].factory(BackendContext(cfg, QuantConfig(), tp))
        xc, wc = tp_copy(x, w, group=tp.tp_group)
        d = routed.dispatch(backend, xc, Routing(_ids(xc.shape[0]), wc))
        y = _toy_experts(d.input, 1.0 + rank)
        return tp_reduce(routed.combine(backend, y, wc, d), tp.tp_group)
    results["local under TP"] = _check(tp_local, (x, w))

    # every EP backend, with uneven ranks, an empty rank, and SP's chunks of 1 token over 2 ranks
    for sizes in ([2, 3], SequenceChunk.of(1, rank, 2).rows_per_rank):
        n = sum(sizes)
        x = torch.randn(n, H, dtype=torch.float64, generator=gen, requires_grad=True)
        w = torch.rand(n, K, dtype=torch.float64, generator=gen, requires_grad=True)
        for name, spec in BACKENDS.items():
            if spec.layouts != "ep":
                continue
            backend = spec.factory(BackendContext(cfg, QuantConfig(), ep, max(max(sizes), 1)))

            def ep_routed(x, w, sizes=sizes, backend=backend):
                mine, wm = shard_rows(x, sizes, rank, ep.ep_group, "ep"), shard_rows(w, sizes, rank, ep.ep_group, "ep")
                ids = _ids(sum(sizes))[sum(sizes[:rank]):sum(sizes[:rank + 1])]
                d = routed.dispatch(backend, mine, Routing(ids, wm))
                out = routed.combine(backend, _toy_experts(d.input), wm, d)
                return gather_rows(out, sizes, rank, ep.ep_group, "ep")
            results[f"{name} {sizes}"] = _check(ep_routed, (x, w))
    return results


# -- whole-model training steps --------------------------------------------------------------

class _Model(nn.Module):
    """embed (replicated linear) -> MoE layer -> head (replicated linear)."""

    def __init__(self, layer: MoELayer, embed: torch.Tensor, head: torch.Tensor) -> None:
        super().__init__()
        self.embed = nn.Linear(embed.shape[1], embed.shape[0], bias=False)
        self.embed.weight = nn.Parameter(embed.clone())
        self.moe = layer
        self.head = nn.Linear(head.shape[1], head.shape[0], bias=False)
        self.head.weight = nn.Parameter(head.clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.moe(self.embed(x)))


def training_steps() -> dict[str, float]:
    """name -> the largest relative error against one device (every name must be tiny)."""
    torch.set_num_threads(1)
    rank = dist.get_rank()
    out: dict[str, float] = {}
    # qwen2-57b-a14b: router, experts, shared experts and their gate; gpt-oss-120b: the router's
    # bias and the experts' biases (under TP the down bias on TP rank 0 alone, added once).
    for preset, layout, backend, tokens in (
            ("qwen2-57b-a14b", "dp2-tp1-ep", "all2all", (5, 0)),
            ("qwen2-57b-a14b", "dp1-tp2-ep", "allgather_reducescatter", (3,)),
            ("qwen2-57b-a14b", "dp1-tp2-noep", "local", (4,)), ("qwen2-57b-a14b", "dp2-tp1-noep", "local", (2, 3)),
            ("qwen2-57b-a14b", "dp2-tp1-ep", "low_latency", (4, 4)), ("gpt-oss-120b", "dp1-tp2-noep", "local", (4,))):
        cfg = PRESETS[preset].config("small")
        gen = torch.Generator().manual_seed(3)
        weights = MoEWeights.random(cfg, gen)
        Hs = cfg.hidden_size
        embed, head = torch.randn(Hs, Hs, generator=gen) / Hs**0.5, torch.randn(Hs, Hs, generator=gen) / Hs**0.5
        for op in ("sum", "mean"):
            if op == "mean" and len(set(tokens)) > 1:
                continue  # the mean convention needs equal token counts per DP rank
            p = ParallelConfig.parse(layout)
            xs = [torch.randn(t, Hs, generator=torch.Generator().manual_seed(20 + d)) for d, t in enumerate(tokens)]
            gs = [torch.randn(t, Hs, generator=torch.Generator().manual_seed(40 + d)) for d, t in enumerate(tokens)]
            scale = 1.0 / (sum(tokens) if op == "sum" else tokens[0])  # sum: L_d = sum / N; mean: L_d = local mean

            one = _Model(MoELayer(cfg, weights=weights), embed, head).requires_grad_(True)
            (sum((one(x) * g).sum() for x, g in zip(xs, gs, strict=True)) / sum(tokens)).backward()
            want = {n: q.grad for n, q in one.named_parameters()}
            want_norm = float(torch.sqrt(sum(g.pow(2).sum() for g in want.values())))

            groups = build_groups(p, "cpu")
            layer = MoELayer(cfg, groups=groups, backend=backend, weights=weights, max_tokens_per_rank=max(tokens))
            model = _Model(layer, embed, head).requires_grad_(True)
            d = p.dp_rank(rank)
            ((model(xs[d]) * gs[d]).sum() * scale).backward()
            reduce_gradients(model, groups, op=op)
            norm = float(grad_norm(model, groups))
            tag = f"{preset}/{layout}/{backend}/{op}"
            for n, q in model.named_parameters():
                ref = shard_of_grad(n.removeprefix("moe."), want[n], layer.shard, cfg) if n.startswith("moe.") else want[n]
                assert q.grad is not None
                out[f"{tag} {n}"] = float((q.grad - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
            out[f"{tag} norm"] = abs(norm - want_norm) / want_norm
            clipped = float(clip_grad_norm_(model, groups, want_norm / 2))
            out[f"{tag} clip returns the norm"] = abs(clipped - norm) / norm
            out[f"{tag} clipped norm"] = abs(float(grad_norm(model, groups)) - want_norm / 2) / (want_norm / 2)
    return out


# (layout, backend, tokens per DP rank, padding rows masked) of the router-loss checks
ROUTER_LOSS_CASES = (("dp2-tp1-ep", "all2all", (3, 5), False), ("dp1-tp2-ep", "all2all", (5,), True),
                     ("dp1-tp2-ep", "allgather_reducescatter", (1,), False), ("dp1-tp2-noep", "local", (4,), True),
                     ("dp2-tp1-noep", "local", (2, 0), False))


def router_loss_inputs(tokens: tuple[int, ...], masked: bool):
    """(cfg, the two layers' weights, tokens, upstream gradients and row masks per DP rank):
    the same in the ranks and in the parent."""
    cfg = PRESETS["mixtral-8x7b"].config("small")
    weights = [MoEWeights.random(cfg, torch.Generator().manual_seed(s)) for s in (5, 6)]
    xs = [torch.randn(t, cfg.hidden_size, generator=torch.Generator().manual_seed(60 + d)) for d, t in enumerate(tokens)]
    gs = [torch.randn(t, cfg.hidden_size, generator=torch.Generator().manual_seed(70 + d)) for d, t in enumerate(tokens)]
    masks = [(torch.arange(t) % 3 != 1).float() if masked else None for t in tokens]
    return cfg, weights, xs, gs, masks


def router_losses() -> list[dict]:
    """For each of ``ROUTER_LOSS_CASES``, on this rank: two stacked MoE layers, the loss
    <g, out> / N + 0.1 * load_balancing_loss + 0.01 * router_z_loss (unmasked cases) backward,
    reduce_gradients: the losses' values, every parameter's gradient (this rank's shard) and x's."""
    from moeshard.training.router_losses import keep_router_logits, load_balancing_loss, router_z_loss

    torch.set_num_threads(1)
    rank = dist.get_rank()
    out = []
    for layout, backend, tokens, masked in ROUTER_LOSS_CASES:
        cfg, weights, xs, gs, masks = router_loss_inputs(tokens, masked)
        p = ParallelConfig.parse(layout)
        groups = build_groups(p, "cpu")
        model = nn.Sequential(*(MoELayer(cfg, groups=groups, backend=backend, weights=w) for w in weights))
        model.requires_grad_(True)
        keep_router_logits(model)
        d = p.dp_rank(rank)
        x = xs[d].clone().requires_grad_()
        y = model(x)
        aux = load_balancing_loss(model, groups, row_mask=masks[d])
        z = router_z_loss(model, groups) if not masked else None
        ((y * gs[d]).sum() / sum(tokens) + 0.1 * aux.share + (0.01 * z.share if z is not None else 0)).backward()
        reduce_gradients(model, groups)
        assert x.grad is not None
        out.append({"aux": float(aux.value), "z": None if z is None else float(z.value), "x": x.grad, "dp_rank": d,
                    "grads": {n: q.grad for n, q in model.named_parameters()},
                    "shards": [layer.shard for layer in model]})
    return out


# (layout, backend, tokens per DP rank of each micro-batch) of the correction-bias updates: EP,
# SP (one token: fewer than tp), TP and DP (an empty rank)
BIAS_UPDATE_CASES = (("dp2-tp1-ep", "all2all", ((3, 5), (4, 2))), ("dp1-tp2-ep", "allgather_reducescatter", ((7,), (1,))),
                     ("dp1-tp2-noep", "local", ((6,), (5,))), ("dp2-tp1-noep", "local", ((4, 0), (2, 6))))
BIAS_STEPS = 3
BIAS_SPEED = 0.02  # large enough that the second step routes differently from the first


class TwoCorrected(nn.Module):
    """Two MoE layers with correction biases on the same tokens, summed: DeepSeek-V3's sigmoid
    with groups and ERNIE 4.5's softmax_bias. Each routes the input itself, so that one device's
    routing is the layout's exactly."""

    def __init__(self, make) -> None:
        super().__init__()
        self.sigmoid, self.softmax = make("deepseek-v3", 11), make("ernie-4.5-21b-a3b", 12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.sigmoid(x) + self.softmax(x)


def bias_update_inputs(tokens: tuple[tuple[int, ...], ...], step: int) -> list[list[torch.Tensor]]:
    """Per micro-batch, per DP rank: its tokens [T, H] of step ``step`` (the same in the ranks
    and in the parent)."""
    H = PRESETS["deepseek-v3"].config("small").hidden_size
    return [[torch.randn(t, H, generator=torch.Generator().manual_seed(1000 * step + 10 * m + d))
             for d, t in enumerate(micro)] for m, micro in enumerate(tokens)]


def bias_model(groups=None, backend: str | None = None) -> TwoCorrected:
    def make(preset: str, seed: int) -> MoELayer:
        cfg = PRESETS[preset].config("small")
        weights = MoEWeights.random(cfg, torch.Generator().manual_seed(seed))
        return MoELayer(cfg, groups=groups, backend=backend, weights=weights, load_window=2)
    return TwoCorrected(make)


def bias_updates() -> list[list[dict]]:
    """For each of ``BIAS_UPDATE_CASES``, on this rank: ``BIAS_STEPS`` steps of two micro-batches'
    forwards then ``update_correction_bias``; after each, both layers' loads and biases."""
    from moeshard.training import update_correction_bias

    torch.set_num_threads(1)
    rank = dist.get_rank()
    out = []
    for layout, backend, tokens in BIAS_UPDATE_CASES:
        p = ParallelConfig.parse(layout)
        groups = build_groups(p, "cpu")
        model = bias_model(groups, backend)
        steps = []
        for step in range(BIAS_STEPS):
            with torch.no_grad():
                for micro in bias_update_inputs(tokens, step):
                    model(micro[p.dp_rank(rank)])
            loads = update_correction_bias(model, groups, BIAS_SPEED)
            steps.append({"loads": [t.clone() for t in loads],
                          "biases": [layer.gate.e_score_correction_bias.clone() for layer in (model.sigmoid, model.softmax)]})
        out.append(steps)
    return out


def all_checks() -> tuple[dict[str, bool | str], dict[str, float], list[dict], list[list[dict]]]:
    """All four, in one world."""
    return gradchecks(), training_steps(), router_losses(), bias_updates()
