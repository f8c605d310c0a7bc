"""Router: gate logits -> top-k expert ids and fp32 weights, for every routing kind of
``moeshard.routing`` (the kind's fields choose each step below).

Shapes: T tokens, H hidden, E experts, K top_k, G groups (``n_group``).

* topk_softmax (gpt-oss, Granite): the top K logits, weights softmax over those K.
* topk_sigmoid (Cohere2-MoE): the top K logits, weights sigmoid of each.
* group_limited_greedy (DeepSeek-V2): softmax; each group scored by its best expert, only the
  best ``topk_group`` groups stay eligible.
* topk_softmax_bias (gpt-oss): topk_softmax on the logits plus the router's bias.
* topk_sigmoid_input (Llama-4): the top K logits, weights sigmoid of those K; the weights scale
  the experts' input (``weighted_rows``), not their output.
* topk_sigmoid (Cohere2-MoE): the top K logits, weights their sigmoid; with ``renormalize``
  divided by their sum.
* topk_sigmoid_biased (Kolibri-1): as topk_sigmoid, selecting on the logits plus the correction
  bias; the weights are the sigmoid of the unbiased logits of the chosen experts.
* softmax_bias (ERNIE 4.5): softmax; selection on p + correction bias, weights the unbiased p.
* sparsemixer (Phi-3.5-MoE): K rounds on the logits (``_masked_rounds``).

* softmax scoring (Mixtral, Qwen2/Qwen3-MoE): p = softmax(logits); take the top K of p;
  with ``renormalize`` divide the K weights by their sum (Mixtral always, Qwen ``norm_topk_prob``).
* sigmoid scoring (DeepSeek-V3): s = sigmoid(logits); selection uses s + correction bias
  (when ``use_correction_bias``), but the weights are the unbiased s of the chosen experts.
  With ``n_group > 1`` each group is scored by the sum of its best two (biased) scores, only the
  best ``topk_group`` groups stay eligible. Optional renormalization, then every weight is
  multiplied by ``routed_scaling_factor``.

Precision: ``router_logits`` computes the logits x W^T (the router's bias included) in the
family's precision, ``MoEConfig.router_dtype``: in fp32 (``"fp32"``), or in the model dtype and
rounded to it (``"model"``, as most transformers routers do); everything after the logits is
computed in fp32 on device, except for a routing kind with ``score_dtype="model"`` (DBRX,
LFM2-MoE), whose scores, selection sums, renormalization and scaling are torch's ops in the
model dtype, rounding as the family's router does; its weights are then widened to fp32.
``route_tokens`` (tokens -> routing) is what the layer, the reference, the harness and the
transformers integration call, so they all pick the same experts from the same logits; ``route``
starts from logits. Nothing synchronises with the host.

Ties: ``torch.topk`` order for equal values is not specified, so ties are broken explicitly in
favour of the lower expert (and group) index, which makes routing reproducible across devices and
batch sizes. Logits rounded to bf16 tie far more often than fp32 ones; the rule is the same.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from moeshard.config import ROUTER_DTYPES, MoEConfig

if TYPE_CHECKING:
    from moeshard.kernels.topk import Groups


@dataclass(frozen=True)
class Routing:
    """topk_ids: int64 [T, K] expert ids; topk_weights: fp32 [T, K] combine weights; logits:
    [T, E] the logits they were computed from (router bias included), which the training
    losses read (``moeshard.training.router_losses``), or None: fp32, or the model dtype where
    the router rounded them to it (``router_dtype="model"``) and the softmax or sigmoid routing
    read them as they are (``_routing_in_kernel``); their fp32 widening is the same values.
    empty_picks: True where topk_ids may hold -1, a pick of no expert (a routing given to
    ``MoEExperts`` with zero-computation experts): no expert computes it, it adds nothing to its
    token's output, and its weight, which must be 0, gets no gradient from the layer."""

    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    logits: torch.Tensor | None = None
    empty_picks: bool = False


def _topk_low_index_first(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices [T, k] of the k largest scores per row; equal scores go to the lower index.

    A stable descending sort gives exactly that order. On CUDA one Triton pass gives the same
    indices (``kernels.topk``: at DeepSeek-V3's 16384 tokens the sort alone took 0.43 ms).
    """
    if scores.is_cuda:
        from moeshard.kernels import topk

        if topk.supported(scores, k):
            return topk.topk_low_index_first(scores, k)
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]


def _fused_selection(choice: torch.Tensor, scores: torch.Tensor,
                     cfg: MoEConfig) -> tuple[torch.Tensor, torch.Tensor] | None:
    """On CUDA without autograd: (ids, weights) of the top K of ``choice`` with their ``scores``,
    renormalized and scaled as ``select_experts`` does, in one Triton pass (``kernels.topk``);
    None where that pass does not apply (then the torch ops run)."""
    if not choice.is_cuda or (torch.is_grad_enabled() and (scores.requires_grad or choice.requires_grad)):
        return None
    from moeshard.kernels import topk

    if not topk.supported(choice, cfg.top_k):
        return None
    return topk.topk_with_weights(choice, scores, cfg.top_k, bool(cfg.renormalize), cfg.routing_kind.weight_floor,
                                  cfg.routed_scaling_factor)


def _groups_of(cfg: MoEConfig) -> Groups:
    """``kernels.topk.Groups`` of cfg's group-limited selection (``NO_GROUPS`` without groups)."""
    from moeshard.kernels import topk

    if cfg.n_group == 1:
        return topk.NO_GROUPS
    return topk.Groups(cfg.n_group, cfg.topk_group, cfg.routing_kind.groups == "max")


def _routing_in_kernel(logits: torch.Tensor, cfg: MoEConfig,
                       correction_bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """On CUDA without autograd: (ids, weights) of softmax or sigmoid routing over all experts
    (``score_then_topk``, a selection bias and groups included) in one Triton pass from the
    logits as they are (``kernels.topk.softmax_topk``, ``sigmoid_topk``); None where that pass
    does not apply (then the torch ops below run).

    The sigmoid is computed as torch's CUDA kernel computes it, so sigmoid routing picks what the
    torch ops pick, with their weights; the softmax's exponential is the GPU's fast one, so its
    picks are the torch ops' up to that rounding. The pass replaces the fp32 copy of
    model-dtype logits, the scores and the selection's launches: with fp8_tensor's scale computed
    in the input quantization, Qwen3-30B-A3B's fp8 layer on one H200 took 13-15 us less at 4096
    tokens and 26-28 us less at 16384 (docs/performance.md, "The layer around the experts: the
    router in one pass"); with a bias or groups also their dozen launches, which a decode step
    runs one after another (DeepSeek-V3's one-token layer 6-11% faster, "DeepSeek-V3's routing
    in one pass")."""
    kind = cfg.routing_kind
    if not (logits.is_cuda and kind.order == "score_then_topk" and kind.scores in ("softmax", "sigmoid")):
        return None
    bias = correction_bias if cfg.use_correction_bias else None
    if torch.is_grad_enabled() and (logits.requires_grad or (bias is not None and bias.requires_grad)):
        return None
    from moeshard.kernels import topk

    groups = _groups_of(cfg)
    if not topk.routing_supported(logits, cfg.top_k, bias, groups):
        return None
    run = topk.softmax_topk if kind.scores == "softmax" else topk.sigmoid_topk
    return run(logits, cfg.top_k, bool(cfg.renormalize), kind.weight_floor, cfg.routed_scaling_factor, bias, groups)


def _group_mask(choice_scores: torch.Tensor, cfg: MoEConfig, group_score: str) -> torch.Tensor:
    """bool [T, E]: True for experts in the ``topk_group`` best groups of each token; a group is
    scored by the sum of its best two scores (``"top2_sum"``) or by its best one (``"max"``)."""
    T, E = choice_scores.shape
    grouped = choice_scores.view(T, cfg.n_group, E // cfg.n_group)
    if group_score == "top2_sum":
        # [T, G]; values only (the mask takes no gradient), and a sum of two is the same in either order.
        best2 = grouped.detach().reshape(T * cfg.n_group, E // cfg.n_group)
        best2 = best2.gather(1, _topk_low_index_first(best2, 2)) if best2.is_cuda else best2.topk(2, dim=-1).values
        group_scores = best2.view(T, cfg.n_group, 2).sum(dim=-1)
    else:
        group_scores = grouped.amax(dim=-1)  # [T, G]
    keep = _topk_low_index_first(group_scores, cfg.topk_group)  # [T, topk_group]
    mask = torch.zeros(T, cfg.n_group, dtype=torch.bool, device=choice_scores.device)
    mask.scatter_(1, keep, True)
    return mask.repeat_interleave(E // cfg.n_group, dim=1)


def _score(values: torch.Tensor, scores: str) -> torch.Tensor:
    if scores == "sqrt_softplus":
        return F.softplus(values).sqrt()  # torch's softplus: x itself above x = 20
    return values.softmax(dim=-1) if scores == "softmax" else values.sigmoid()


def _masked_rounds(logits: torch.Tensor, k: int, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """logits fp32 [T, E] -> (ids int64 [T, k], weights fp32 [T, k]) of k rounds: round r picks
    the best logit m among the experts not picked yet (ties to the lower index); the experts j
    with ``(m - s_j) / max(|s_j|, m) > 2 * eps`` are masked (the distance is relative to the
    larger of |s_j| and m, taken over the original logits s), and the pick's weight is its
    softmax probability among the remaining unmasked experts."""
    remaining = logits
    ids, weights = [], []
    for _ in range(k):
        pick = _topk_low_index_first(remaining, 1)  # [T, 1]
        best = remaining.gather(1, pick)
        far = (best - logits) / logits.abs().clamp(min=best) > 2 * eps
        weights.append(remaining.masked_fill(far, float("-inf")).softmax(dim=-1).gather(1, pick))
        ids.append(pick)
        remaining = remaining.scatter(1, pick, float("-inf"))
    return torch.cat(ids, dim=1), torch.cat(weights, dim=1)


def route(logits: torch.Tensor, cfg: MoEConfig, correction_bias: torch.Tensor | None = None,
          router_bias: torch.Tensor | None = None) -> Routing:
    """Routes T tokens from their logits with the routing kind ``cfg.scoring`` (``moeshard.routing``).

    logits: [T, E] router logits (any float dtype; computed on in fp32).
    correction_bias: [E] DeepSeek-V3 ``e_score_correction_bias``; required iff ``cfg.use_correction_bias``.
    router_bias: [E] the router linear's bias, added to the logits in fp32; required iff the kind
      has ``router_bias``.
    """
    if logits.dim() != 2 or logits.shape[1] != cfg.num_experts:
        raise ValueError(f"route: logits must be [T, num_experts={cfg.num_experts}], got {tuple(logits.shape)}")
    _check_biases(cfg, correction_bias, router_bias)
    logits = logits.float()
    if router_bias is not None:
        logits = logits + router_bias.float().view(1, -1)
    return select_experts(logits, cfg, correction_bias)


def route_tokens(x: torch.Tensor, gate_weight: torch.Tensor, cfg: MoEConfig,
                 correction_bias: torch.Tensor | None = None, router_bias: torch.Tensor | None = None) -> Routing:
    """Routes the tokens x [T, H] (the model dtype): ``router_logits`` in ``cfg.router_dtype``
    (gate_weight [E, H], router_bias [E] inside the product, as the family's router adds it),
    then ``route``'s selection in fp32. correction_bias, router_bias: as ``route``."""
    if gate_weight.dim() != 2 or gate_weight.shape[0] != cfg.num_experts:
        raise ValueError(f"route_tokens: the router weight must be [num_experts={cfg.num_experts}, H], got "
                         f"{tuple(gate_weight.shape)}")
    _check_biases(cfg, correction_bias, router_bias)
    return select_experts(router_logits(x, gate_weight, cfg.router_dtype, router_bias, widen=False), cfg,
                          correction_bias)


def _check_biases(cfg: MoEConfig, correction_bias: torch.Tensor | None, router_bias: torch.Tensor | None) -> None:
    kind = cfg.routing_kind
    if cfg.use_correction_bias and correction_bias is None:
        raise ValueError("route: cfg.use_correction_bias is True but no correction_bias was given")
    if kind.router_bias != (router_bias is not None):
        raise ValueError(f"route: routing kind {kind.name!r} has router_bias={kind.router_bias}, but a router bias was "
                         f"{'not ' if router_bias is None else ''}given")


def select_experts(logits: torch.Tensor, cfg: MoEConfig, correction_bias: torch.Tensor | None) -> Routing:
    """logits [T, E] (the router bias included, as ``router_logits`` adds it; fp32 or wider, or
    the model dtype as ``router_logits(..., widen=False)`` returns them, which every path but
    the one-pass routing widens to fp32 first) -> the routing of ``cfg``'s kind: the second half
    of ``route_tokens``, for a caller that computes the logits itself (the gradient reference)."""
    kind = cfg.routing_kind
    in_model_dtype = kind.score_dtype == "model"
    fused = None if in_model_dtype else _routing_in_kernel(logits, cfg, correction_bias)
    if fused is not None:
        return Routing(topk_ids=fused[0], topk_weights=fused[1], logits=logits)
    given = logits
    if in_model_dtype:
        # The logits' values are model-dtype values (router_dtype "model"), so this is exact.
        logits = logits.to(cfg.dtype)
    elif logits.dtype in (torch.bfloat16, torch.float16):
        logits = logits.float()
    if kind.order == "topk_then_score":
        # Select on the logits (the scores are monotone in them), plus the selection bias where
        # the kind has one (in fp32, as the layer holds it), then score the K selected only.
        choice = logits
        if cfg.use_correction_bias:
            assert correction_bias is not None  # refused by _check_biases when missing
            choice = logits.float() + correction_bias.float().view(1, -1)
        ids = _topk_low_index_first(choice, cfg.top_k)
        weights = _score(logits.gather(1, ids), kind.scores)
    elif kind.order == "masked_rounds":
        ids, weights = _masked_rounds(logits, cfg.top_k, kind.mask_eps)
    else:
        scores = _score(logits, kind.scores)
        choice = scores
        if cfg.use_correction_bias:
            assert correction_bias is not None  # refused by _check_biases when missing
            # In fp32 for every kind: the layer holds the bias in fp32, and LFM2-MoE's router adds
            # its fp32 bias to its model-dtype scores in fp32 as well (torch's type promotion).
            choice = scores.float() + correction_bias.float().view(1, -1)
        if cfg.n_group > 1:
            assert kind.groups is not None  # MoEConfig refuses n_group > 1 for a kind without groups
            # Experts outside the kept groups can never win: -inf is below any score.
            choice = choice.masked_fill(~_group_mask(choice, cfg, kind.groups), float("-inf"))
        fused = None if in_model_dtype else _fused_selection(choice, scores, cfg)
        if fused is not None:
            return Routing(topk_ids=fused[0], topk_weights=fused[1], logits=logits)
        ids = _topk_low_index_first(choice, cfg.top_k)
        weights = scores.gather(1, ids)
    if cfg.renormalize:
        total = weights.sum(dim=-1, keepdim=True)
        weights = weights / (total + kind.weight_floor if kind.floor_added else total.clamp_min(kind.weight_floor))
    if cfg.routed_scaling_factor != 1.0:
        weights = weights * cfg.routed_scaling_factor
    if in_model_dtype:
        return Routing(topk_ids=ids, topk_weights=weights.float(), logits=given)
    return Routing(topk_ids=ids, topk_weights=weights, logits=logits)


# K-chunk lengths of the fp32 router on tensor cores, longest first (one of them must divide H).
TENSOR_CORE_CHUNKS = (512, 256, 128)


def _tensor_core_chunk(x: torch.Tensor, gate_weight: torch.Tensor) -> int | None:
    """The K chunk ``chunked_logits`` may use for fp32 logits of x and W, or None: on CUDA, x and
    W both bf16 or both fp16 (every product is exact in fp32), contiguous rows, no gradient
    wanted (the batched GEMM with fp32 output has no backward), H a multiple of a chunk."""
    if not (x.is_cuda and x.dim() == 2 and x.dtype in (torch.bfloat16, torch.float16) and gate_weight.dtype == x.dtype):
        return None
    if torch.is_grad_enabled() and (x.requires_grad or gate_weight.requires_grad):
        return None
    if not (x.is_contiguous() and gate_weight.is_contiguous()):
        return None
    return next((c for c in TENSOR_CORE_CHUNKS if x.shape[1] % c == 0), None)


def chunked_logits(x: torch.Tensor, gate_weight: torch.Tensor, chunk: int) -> torch.Tensor:
    """fp32 [T, E] = x W^T for x [T, H] and W [E, H] of one 16-bit dtype (CUDA): the tensor cores
    multiply each K chunk of ``chunk`` columns with fp32 output (each product exact), and the
    H / chunk partial logits are summed in fp32. Why not one fp32 GEMM: on one H200 at DeepSeek-V3's
    16384 tokens (scripts/layer_profile.py, 2026-12-01) it took 1.53 ms on the CUDA cores plus
    0.37 ms to widen x, and was 9.7e-6 from the exact logits; in chunks of 512 this takes 0.21 ms
    and is 6.0e-6 from them. One tensor-core GEMM over all of K (0.09 ms) was 9.5e-5 from them."""
    T, H = x.shape
    n = H // chunk
    parts = torch.bmm(x.view(T, n, chunk).transpose(0, 1), gate_weight.view(-1, n, chunk).permute(1, 2, 0),
                      out_dtype=torch.float32)
    return parts.sum(dim=0)


def router_logits(x: torch.Tensor, gate_weight: torch.Tensor, router_dtype: str,
                  bias: torch.Tensor | None = None, widen: bool = True) -> torch.Tensor:
    """x: [T, H] the model dtype; gate_weight: [E, H] (any float dtype); bias: [E] or None ->
    fp32 logits [T, E] = x W^T + b in ``router_dtype`` (``config.ROUTER_DTYPES``; with ``widen``
    False the ``"model"`` logits stay in the model dtype, for ``select_experts``):

    * ``"fp32"``: x, W and b widened to fp32, one fp32 product (on CUDA, for x and W of one
      16-bit dtype without gradients, ``chunked_logits``: exact products, fp32 sums, closer to
      the exact logits than the fp32 GEMM and 7x faster at DeepSeek-V3's shapes);
    * ``"model"``: W and b cast to x's dtype, the product in that dtype (fp32 accumulation,
      rounded once to the model dtype, as ``F.linear`` in bf16 does on CPU and CUDA), then
      widened: the values transformers' router computes.

    Every path that routes tokens (the layer, the reference, the harness, the integration) calls
    this with the config's ``router_dtype``, so they pick the same experts.
    """
    if router_dtype == "fp32":
        chunk = _tensor_core_chunk(x, gate_weight)
        if chunk:
            logits = chunked_logits(x, gate_weight, chunk)
            return logits if bias is None else logits + bias.float()
        return F.linear(x.float(), gate_weight.float(), None if bias is None else bias.float())
    if router_dtype == "model":
        logits = F.linear(x, gate_weight.to(x.dtype), None if bias is None else bias.to(x.dtype))
        return logits.float() if widen else logits
    raise ValueError(f"router_logits: router_dtype {router_dtype!r} is not one of {list(ROUTER_DTYPES)}")


def weighted_rows(x: torch.Tensor, routing: Routing, dtype: torch.dtype) -> tuple[torch.Tensor, Routing]:
    """Weights on the input (a routing kind with ``weights_on_input``): x [T, H] and routing
    [T, K] -> rows [T * K, H] in ``dtype``, row t*K + k = x[t] * w[t, k] (the weight rounded to
    the model dtype first, then the product, as Llama-4 computes it), each routed to its one
    expert ids[t, k] with weight 1; the experts' outputs of a token's K rows are then summed.
    The layer and the reference both build the experts' input with this function."""
    T, K = routing.topk_ids.shape
    w = routing.topk_weights.to(dtype).float()
    rows = (x.float().unsqueeze(1) * w.unsqueeze(-1)).to(dtype).reshape(T * K, x.shape[1])
    ones = torch.ones(T * K, 1, dtype=torch.float32, device=x.device)
    return rows, Routing(routing.topk_ids.reshape(T * K, 1), ones, empty_picks=routing.empty_picks)
