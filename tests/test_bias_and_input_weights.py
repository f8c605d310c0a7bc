"""The parts gpt-oss and Llama-4 added to the layer, computed by hand: a router with a bias,
sigmoid weights applied to the expert's input, expert biases (under TP added once, under EP
and load-balancing replicas held with their expert), the fused layouts a checkpoint may store.
The layer and the reference are both checked against the hand computation, and against what a
dropped bias or misplaced weight would give. The Triton kernels' epilogues add the biases too:
tests/test_kernel_epilogues.py."""

import math

import pytest
import torch

from moeshard.checkpoint.fused import LAYOUTS
from moeshard.config import MoEConfig, QuantConfig
from moeshard.eplb.placement import Placement
from moeshard.experts.base import ExpertInput
from moeshard.experts.grouped import GroupedExperts
from moeshard.layer import MoELayer
from moeshard.parallel.config import ParallelConfig
from moeshard.reference import reference_forward
from moeshard.router import route, weighted_rows
from moeshard.sharding import ShardSpec, prepare_experts, shard_experts, shard_of, shard_spec
from moeshard.weights import MoEWeights


def cfg(**kw) -> MoEConfig:
    return MoEConfig(**{"num_experts": 4, "top_k": 2, "hidden_size": 8, "intermediate_size": 8, "renormalize": False,
                        **kw})


def test_topk_softmax_bias_selects_and_weighs_the_biased_logits():
    c = cfg(scoring="topk_softmax_bias")
    logits = torch.tensor([[0.0, 2.0, -1.0, 1.0]])
    with pytest.raises(ValueError, match="has router_bias=True, but a router bias was not given"):
        route(logits, c)
    r = route(logits, c, router_bias=torch.tensor([0.0, 0.0, 5.0, 0.0]))  # biased logits [0, 2, 4, 1]
    assert r.topk_ids.tolist() == [[2, 1]]
    assert r.topk_weights[0].tolist() == pytest.approx([math.e**2 / (math.e**2 + 1), 1 / (math.e**2 + 1)])
    with pytest.raises(ValueError, match="has router_bias=False, but a router bias was given"):
        route(logits, cfg(scoring="topk_softmax"), router_bias=torch.zeros(4))


def test_topk_sigmoid_input_weights_are_sigmoids_of_the_selected_logits():
    logits = torch.tensor([[0.0, 2.0, -1.0, 1.0], [3.0, -2.0, 0.5, 0.5]])
    r = route(logits, cfg(scoring="topk_sigmoid_input", top_k=1))
    assert r.topk_ids.tolist() == [[1], [0]]
    assert r.topk_weights.flatten().tolist() == pytest.approx([1 / (1 + math.exp(-2)), 1 / (1 + math.exp(-3))])
    two = route(logits, cfg(scoring="topk_sigmoid_input"))  # not renormalized: each its own sigmoid
    assert two.topk_ids.tolist() == [[1, 3], [0, 2]]
    assert two.topk_weights[0].tolist() == pytest.approx([1 / (1 + math.exp(-2)), 1 / (1 + math.exp(-1))])


def _by_hand(x, w: MoEWeights, c: MoEConfig, on_input: bool | None = None) -> torch.Tensor:
    """The block, token by token and expert by expert, in fp64 (as gpt-oss and Llama-4 define it);
    on_input: weigh the expert's input (default: as the routing kind says) or its output."""
    on_input = c.routing_kind.weights_on_input if on_input is None else on_input
    I = c.intermediate_size
    x64 = x.double()
    logits = x64 @ w.gate.double().T
    if w.gate_bias is not None:
        logits = logits + w.gate_bias.double()
    out = torch.zeros_like(x64)
    for t in range(x.shape[0]):
        top = torch.sort(logits[t], descending=True, stable=True).indices[:c.top_k]
        scores = logits[t, top].softmax(-1) if c.scoring == "topk_softmax_bias" else logits[t, top].sigmoid()
        for e, s in zip(top.tolist(), scores.tolist(), strict=True):
            inp = x64[t] * s if on_input else x64[t]
            gu = w.gate_up[e].double() @ inp
            if w.gate_up_bias is not None:
                gu = gu + w.gate_up_bias[e].double()
            h = c.activation_kind(gu[:I], gu[I:])
            y = w.down[e].double() @ h
            if w.down_bias is not None:
                y = y + w.down_bias[e].double()
            out[t] += y if on_input else s * y
    return out


@pytest.mark.parametrize("kind", ["gpt_oss", "llama4"])
def test_layer_and_reference_compute_the_block_by_hand(kind):
    if kind == "gpt_oss":
        c = cfg(scoring="topk_softmax_bias", activation="swiglu_clamped", expert_bias=True)
    else:
        c = cfg(scoring="topk_sigmoid_input", top_k=2)  # the input-weight rule holds for any top-k
    torch.manual_seed(1)
    w = MoEWeights.random(c)
    x = torch.randn(6, 8) * 2
    want = _by_hand(x, w, c)
    layer = MoELayer.from_state_dict(w.state_dict(), c)
    assert torch.allclose(layer(x).double(), want, atol=1e-5)
    assert torch.allclose(reference_forward(x, w, c).out, want, atol=1e-12)
    # What a layer that dropped the biases / weighed the output would give is far from it.
    if kind == "gpt_oss":
        wrong = MoEWeights(**{**w.__dict__, "gate_up_bias": torch.zeros_like(w.gate_up_bias),
                              "down_bias": torch.zeros_like(w.down_bias)})
        assert (_by_hand(x, wrong, c) - want).abs().max() > 0.1
    else:
        assert (_by_hand(x, w, c, on_input=False) - want).abs().max() > 0.1


def test_weighted_rows_round_like_the_family():
    """bf16: the weight is rounded to the model dtype, then the product (Llama-4's x * score)."""
    x = torch.randn(3, 8).bfloat16()
    r = route(torch.randn(3, 4), cfg(scoring="topk_sigmoid_input", top_k=1))
    rows, routing = weighted_rows(x, r, torch.bfloat16)
    assert torch.equal(rows, x * r.topk_weights.bfloat16())
    assert routing.topk_weights.tolist() == [[1.0]] * 3 and torch.equal(routing.topk_ids, r.topk_ids)


def _experts(c: MoEConfig, weights, rows: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return GroupedExperts(c.activation, c.dtype)(ExpertInput(rows, ids), weights)


def test_expert_biases_under_tp_are_added_once():
    """TP2: each rank keeps its slice of the gate_up bias; only TP rank 0 adds the down bias, so the
    ranks' partial sums add up to the whole expert (what the all-reduce computes)."""
    c = cfg(scoring="topk_softmax_bias", activation="swiglu_clamped", expert_bias=True)
    w = MoEWeights.random(c, torch.Generator().manual_seed(2))
    rows, ids = torch.randn(10, 8), torch.randint(0, 4, (10,))
    whole = _experts(c, shard_experts(w.gate_up, w.down, c, QuantConfig(), ShardSpec(0, 4), w.gate_up_bias,
                                      w.down_bias), rows, ids)
    shards = [shard_experts(w.gate_up, w.down, c, QuantConfig(), ShardSpec(0, 4, r, 2), w.gate_up_bias, w.down_bias)
              for r in range(2)]
    assert shards[0].down_bias is not None and shards[1].down_bias is None
    assert torch.equal(shards[1].gate_up_bias, torch.cat([w.gate_up_bias[:, 4:8], w.gate_up_bias[:, 12:16]], dim=1))
    total = sum(_experts(c, s, rows, ids) for s in shards)
    assert torch.allclose(total, whole, atol=1e-5)
    assert (total + w.down_bias[ids] - whole).abs().max() > 0.1  # a bias added by both ranks would show


class _UnwrittenPadding(GroupedExperts):
    """The portable experts whose GEMM leaves the rows past the last offset (padding) as NaN: what
    ``torch._grouped_mm`` may leave there (it does not write them), made certain."""

    def gemm(self, a, w, offsets, padded=True):
        out = super().gemm(a, w, offsets, padded)
        unwritten = (torch.arange(out.shape[0]) >= offsets[-1]).unsqueeze(1)
        return torch.where(unwritten, float("nan"), out)


def test_expert_bias_gradients_leave_padding_rows_out():
    """Padding rows (expert id -1: what fixed-capacity buffers such as low_latency's deliver) are
    never computed by the grouped GEMM, whose rows there hold any value, NaN too: they take no bias,
    and their gradient reaches no bias. Every gradient equals that of the rows without padding.
    (SiLU: its derivative at NaN is NaN, which a product with the padding rows' zero gradient keeps.)"""
    c = cfg(expert_bias=True)
    w = MoEWeights.random(c, torch.Generator().manual_seed(4))
    experts = shard_experts(w.gate_up, w.down, c, QuantConfig(), ShardSpec(0, 4), w.gate_up_bias, w.down_bias)
    params = {"gate_up": experts.gate_up, "down": experts.down, "gate_up_bias": experts.gate_up_bias,
              "down_bias": experts.down_bias}
    g = torch.Generator().manual_seed(5)
    rows, ids, upstream = torch.randn(10, 8, generator=g), torch.randint(0, 4, (10,), generator=g), torch.randn(10, 8)

    def grads(rows, ids, upstream):
        for p in params.values():
            p.grad = None
            p.requires_grad_(True)
        x = rows.clone().requires_grad_()
        (_UnwrittenPadding(c.activation, c.dtype)(ExpertInput(x, ids), experts) * upstream).sum().backward()
        return x.grad, {name: p.grad.clone() for name, p in params.items()}

    want_x, want = grads(rows, ids, upstream)
    got_x, got = grads(torch.cat([rows, torch.full((6, 8), float("nan"))]), torch.cat([ids, torch.full((6,), -1)]),
                       torch.cat([upstream, torch.randn(6, 8)]))
    for name in params:
        assert torch.isfinite(got[name]).all() and torch.allclose(got[name], want[name], atol=1e-5), name
    assert torch.allclose(got_x[:10], want_x, atol=1e-5) and torch.equal(got_x[10:], torch.zeros(6, 8))
    for p in params.values():
        p.requires_grad_(False)


def test_expert_biases_travel_with_their_expert_under_ep_and_replicas():
    c = cfg(expert_bias=True)
    w = MoEWeights.random(c, torch.Generator().manual_seed(3))
    prepared = prepare_experts(w.gate_up, w.down, c, QuantConfig("fp8_tensor"), w.gate_up_bias, w.down_bias)
    placement = Placement(4, 2, (0, 1, 3, 2, 3, 0))  # experts 3 and 0 with a replica each
    layout = ParallelConfig(2, 1, True)
    for rank in range(2):
        spec = shard_spec(layout, rank, 4, placement)
        mine = shard_of(prepared, c, QuantConfig("fp8_tensor"), spec)
        direct = shard_experts(w.gate_up, w.down, c, QuantConfig("fp8_tensor"), spec, w.gate_up_bias, w.down_bias)
        experts = list(spec.logical_experts)
        for got in (mine, direct):
            assert torch.equal(got.gate_up_bias, w.gate_up_bias[experts])  # biases are never quantized
            assert torch.equal(got.down_bias, w.down_bias[experts])
    with pytest.raises(ValueError, match=r"down_bias was not given, but MoEConfig.expert_bias=True"):
        shard_experts(w.gate_up, w.down, c, QuantConfig(), ShardSpec(0, 4), w.gate_up_bias, None)


def test_weights_refuse_missing_biases_naming_them():
    c = cfg(scoring="topk_softmax_bias", expert_bias=True)
    w = MoEWeights.random(c)
    state = w.state_dict()
    assert {"gate.bias", "experts.gate_up_proj_bias", "experts.down_proj_bias"} <= set(state)
    assert torch.equal(MoEWeights.from_state_dict(state, c).down_bias, w.down_bias)
    for key in ("gate.bias", "experts.down_proj_bias"):
        with pytest.raises(ValueError, match=f"missing tensor {key!r}"):
            MoEWeights.from_state_dict({k: v for k, v in state.items() if k != key}, c)
    with pytest.raises(ValueError, match="MoEWeights.gate_bias: given, but the config has no use for it"):
        MoEWeights(**{**MoEWeights.random(cfg()).__dict__, "gate_bias": torch.zeros(4)}).validate(cfg())


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_fused_layouts_read_back_moeshards_layout(name):
    """Each stored layout, built here from moeshard's [E, 2I, H] / [E, H, I] by its definition,
    converts back whole and slice by slice (a TP half of I), biases too where the layout has them.
    The ungated ``up_rows`` holds [E, I, H] up rows alone, stored as moeshard holds them."""
    layout = LAYOUTS[name]
    E, H, I = 3, 5, 4
    P = layout.products
    gate_up, down = torch.randn(E, P * I, H), torch.randn(E, H, I)
    bias = torch.randn(E, P * I)
    gate, up = gate_up[:, :I], gate_up[:, I:]
    if layout.stacked:  # DBRX: gate, up and down^T, each expert's I rows one after another
        stored = [gate.reshape(E * I, H), up.reshape(E * I, H), down.transpose(1, 2).reshape(E * I, H)]
    else:
        stored_gu = torch.stack([gate, up], dim=2).flatten(1, 2) if layout.interleaved else gate_up  # rows 2i, 2i + 1
        stored = [stored_gu.transpose(1, 2), down.transpose(1, 2)] if layout.transposed else [stored_gu, down]
        assert tuple(tuple(t.shape) for t in stored) == layout.shapes(E, H, I)
    assert len(stored) == layout.tensors
    assert tuple(tuple(t.shape) for t in stored) == layout.stored_shapes(E, H, I)
    gu, dn = layout.canonical_tensors(stored, E)
    assert torch.equal(gu, gate_up) and torch.equal(dn, down)
    for lo, hi in ((0, 2), (2, 4), (0, 4)):
        for e in range(E):
            gu_rows, dn_rows = layout.expert_rows([stored[which][index]
                                                   for which, index in layout.expert_reads(e, lo, hi, I)])
            assert torch.equal(gu_rows, torch.cat([gate_up[e, lo:hi], gate_up[e, I + lo:I + hi]][:P]))
            assert torch.equal(dn_rows, down[e, :, lo:hi])
    if layout.stacked:
        return
    stored_bias = torch.stack([bias[:, :I], bias[:, I:]], dim=2).flatten(1) if layout.interleaved else bias
    assert torch.equal(layout.canonical_bias(stored_bias), bias)
    for lo, hi in ((0, 2), (2, 4), (0, 4)):
        for e in range(E):
            b = layout.bias_rows([stored_bias[index] for index in layout.bias_reads(e, lo, hi, I)])
            assert torch.equal(b, torch.cat([bias[e, lo:hi], bias[e, I + lo:I + hi]]))
