"""The single-device reference: every routed row through its expert in fp64.

It uses the same dequantized weights as the layer and quantizes activations exactly as the layer
does (same quantization functions, same grouping), so parallel and kernel errors can be told
apart from quantization error and tolerances stay tight:

* input activations: one domain for per-tensor scales (``input_amax``, default: amax of ``x``);
* the intermediate h = act(gate) * up is rounded to the model dtype as the layer's GEMM output
  is, split into ``intermediate_shards`` column slices (the TP slices of I), and each slice is
  quantized with per-tensor scales taken per expert over that expert's rows;
* shared experts quantized (``QuantConfig.shared``): one expert of [gate; up] and down,
  quantized like a routed expert, every token through it (``_quantized_shared``), priced with
  the same ``accumulation`` (the layer declares the larger of its kernels').

Routing kinds and biases as the layer has them: the logits come from ``router.route_tokens`` in
``cfg.router_dtype``, as the layer's do; the router's bias (``MoEWeights.gate_bias``) is part of
them; with weights on the input (``weights_on_input``) each (token, k) pair is a row x * w of
its own (``router.weighted_rows``), through its expert unweighted, and a token's K rows are
summed; expert biases (``expert_bias``) are added to the rounded gate_up product in
fp32 and rounded again (as the layer adds them), and to the down product exactly.

Ambiguous roundings. A correct kernel computes the gate_up sums in another order and precision
than fp64, so a sum that lies within that accumulation error of a rounding boundary (of the
model dtype, then of the fp8 / nvfp4 grid of h) may legitimately round either way, and one such
flip moves the output by a whole quantization step of h times a column of the down weights.
The reference therefore also evaluates h at the four corners of the error box of every sum
(gate and up each shifted by -+ ``accumulation * sum |x| |w|``, each rounded as the layer rounds
it), takes each element's smallest and largest candidate, quantizes both with the scales of the
smallest-magnitude and of the largest-magnitude candidates (a scale group's amax may flip too),
and reports ``slack = sum_k w_k * (max |q_candidate - q| @ |W2|^T + accumulation * |q| @ |W2|^T)``:
nonzero only where a rounding is in doubt, plus the down GEMM's own accumulation error.
``moeshard.tolerances.compare`` adds it to the table's bound.

Output roundings. The layer rounds every routed expert's output to the model dtype (each TP
slice's partial output on its rank, a biased one again after its bias is added), and computes
the unquantized shared MLP in the model dtype: its gate and up products, each operation of its
activation, its output, the shared gate's linear, sigmoid and product, and ``shared_scale``'s
product all round. The reference's values round where the result is determined (h, as above;
the shared MLP's activation runs on the rounded products in the model dtype, as the layer runs
it) and prices the rest: a rounding moves a value v by at most u |v| (``unit_roundoff``), so
each rounded output adds u times its magnitude (plus the slack it already has) to the slack,
carried through the combine weights, the gate (sigmoid is 1/4-Lipschitz) and the scale. The
table's rtol is relative to the final sum, which cancellation between experts can make far
smaller than the terms whose roundings it has to cover; without these terms inputs of twice
the usual scale already failed correct layers.

Cost. The GEMMs run per expert (fp64, on that expert's rows); the activation and every
quantization of h (the value and the slack's four candidates, for every expert and TP slice)
run as one batch over all routed rows (``expert_rows_batched``), each element computed exactly as
a loop over experts would compute it. ``DequantizedExperts`` holds the quantized-then-dequantized
expert weights so that callers evaluating many references on the same weights (the
verification matrix) quantize them once.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from moeshard.activations import get_activation
from moeshard.config import MoEConfig, QuantConfig
from moeshard.experts.base import ExpertWeights, activate
from moeshard.numerics import ACCUMULATION, Reference, unit_roundoff
from moeshard.quant import QuantizedActivations, QuantizedWeight, fake_quantize_activations, get_scheme, quantize_weight
from moeshard.router import route_tokens, weighted_rows
from moeshard.validate import boolean, finite_float, size
from moeshard.weights import MoEWeights

__all__ = ["DequantizedExperts", "Reference", "expert_reference", "expert_rows", "expert_rows_batched",
           "reference_forward", "shared_reference"]


def _per_tensor(scheme: str) -> bool:
    return get_scheme(scheme, "reference: quant").per_tensor_activation


@dataclass(frozen=True, eq=False)
class DequantizedExperts:
    """The routed experts as the layer computes with them: quantized with ``scheme`` (per expert,
    as the layer's sharding does before it slices), then dequantized, in fp64.

    gate_up: fp64 [E, 2I, H]; down: fp64 [E, H, I]; scheme: the quantization they went through.
    gate_up_bias: fp64 [E, 2I] and down_bias: fp64 [E, H], the experts' biases rounded to the
    model dtype (never quantized), or None without ``expert_bias``.
    Build with ``of``; one instance serves every case that shares the weights and the scheme.
    """

    gate_up: torch.Tensor
    down: torch.Tensor
    scheme: str
    gate_up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None

    @functools.cached_property
    def gate_up_abs(self) -> torch.Tensor:
        return self.gate_up.abs()

    @functools.cached_property
    def down_abs(self) -> torch.Tensor:
        return self.down.abs()

    @staticmethod
    def of(weights: MoEWeights, scheme: str, dtype: torch.dtype, device=None,
           only: list[int] | None = None) -> DequantizedExperts:
        """weights: full weights (their routed experts, in any dtype; rounded to ``dtype`` first);
        only: keep just these experts, in this order (default: all E)."""
        def prepared(w: torch.Tensor) -> torch.Tensor:
            w = (w if only is None else w[only]).to(device=device, dtype=dtype)
            if scheme != "none":  # scales are per expert: the whole tensor quantizes like each expert alone
                w = quantize_weight(w, scheme).dequantize(torch.float32)
            return w.double()
        if weights.gate_up is None or weights.down is None:
            raise ValueError(f"DequantizedExperts.of: weights.gate_up and weights.down must be the full routed experts, "
                             f"got gate_up={'None' if weights.gate_up is None else 'a tensor'}, "
                             f"down={'None' if weights.down is None else 'a tensor'}")
        def bias(b: torch.Tensor | None) -> torch.Tensor | None:
            return None if b is None else (b if only is None else b[only]).to(device=device, dtype=dtype).double()
        return DequantizedExperts(prepared(weights.gate_up), prepared(weights.down), scheme,
                                  bias(weights.gate_up_bias), bias(weights.down_bias))


def _fake_quant(x: torch.Tensor, scheme: str, amax: torch.Tensor | None,
                scales_from: torch.Tensor | None = None) -> torch.Tensor:
    if scheme == "none":
        return x.double()
    return fake_quantize_activations(x, scheme, amax=amax if _per_tensor(scheme) else None,
                                     scales_from=scales_from).double()


def _activated(gate_up: torch.Tensor, activation: str, dtype: torch.dtype,
               bias: torch.Tensor | None = None, in_model_dtype: bool = False) -> torch.Tensor:
    """fp64 gate_up sums [R, 2I] -> h = act(gate) * up [R, I] in ``dtype``, each factor rounded
    to ``dtype`` first, as the layer's GEMM epilogue rounds them; bias: fp64 [R, 2I] (each row
    its expert's gate_up bias, model-dtype values) added in fp32 to the rounded product and
    rounded again, as the portable experts add it. The activation is computed in fp32 and
    rounded once (the experts' ``activate``), or with ``in_model_dtype`` by the kind itself on
    the model-dtype factors, each of its operations rounding, as the unquantized shared MLP
    computes it."""
    g = gate_up.to(dtype)
    if bias is not None:
        g = (g.float() + bias.float()).to(dtype)
    if in_model_dtype:
        return get_activation(activation).apply(g).to(dtype)
    return activate(g, activation, dtype)


def _group_amax(values: torch.Tensor, group: torch.Tensor, num_groups: int) -> torch.Tensor:
    """values: [R, S, W]; group: int64 [R] -> fp32 [R, S]: the amax of |values| over all rows of
    the row's group, per slice s (the per-tensor amax of one expert's rows in one TP slice)."""
    row_max = values.abs().amax(dim=2).float() if values.shape[2] else values.new_zeros(values.shape[:2], dtype=torch.float32)
    seg = torch.zeros(num_groups, values.shape[1], dtype=torch.float32, device=values.device)
    seg = seg.scatter_reduce(0, group.unsqueeze(1).expand_as(row_max), row_max, reduce="amax", include_self=True)
    return seg[group]


def _quantized_candidates(values: list[torch.Tensor], scales: list[torch.Tensor], group: torch.Tensor,
                          num_groups: int, scheme: str, shards: int) -> list[torch.Tensor]:
    """Each ``values[c]`` [R, I] (model dtype) quantized with the scales of ``scales[c]`` (same
    shape) as the layer quantizes h: per TP slice of I (``shards`` slices), per-tensor scales
    taken per group (expert) of rows and slice. Returns fp64 [R, I] each.

    One quantization call for every candidate, expert and slice: a slice of a row becomes a row
    of its own ([R * shards, I / shards], the slices are aligned to the scheme's blocks), and a
    per-tensor amax becomes a per-row one, which quantizes each row exactly as the scalar would.
    """
    R, I = values[0].shape
    width = I // shards
    folded = [v.reshape(R * shards, width) for v in values]
    source = [s.reshape(R * shards, width) for s in scales]
    amax = None
    if _per_tensor(scheme):
        amax = torch.cat([_group_amax(s.reshape(R, shards, width), group, num_groups).reshape(R * shards, 1)
                          for s in scales])
    q = fake_quantize_activations(torch.cat(folded), scheme, amax=amax, scales_from=torch.cat(source)).double()
    return [part.reshape(R, I) for part in q.split(R * shards)]


def expert_rows_batched(xs: list[torch.Tensor], w13s: list[torch.Tensor], w2s: list[torch.Tensor], activation: str,
                        dtype: torch.dtype, scheme: str, shards: int = 1, accumulation: float = ACCUMULATION["fp32"],
                        with_slack: bool = True, abs_weights: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None,
                        biases: tuple[list[torch.Tensor], list[torch.Tensor | None]] | None = None,
                        in_model_dtype: bool = False) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """``expert_rows`` for several experts at once: (y, slack) of ``xs[g]`` through expert
    (``w13s[g]``, ``w2s[g]``) for each g. The GEMMs run per expert; the activation and the
    quantizations of h (the value and the slack's four candidates, every expert and TP slice)
    run in one pass over all rows. Every element is computed exactly as ``expert_rows`` would
    compute it for one expert. ``with_slack=False`` skips the slack (returns None for it);
    ``abs_weights``: ``(|w13s|, |w2s|)`` when the caller keeps them; ``biases``: the experts'
    ``(gate_up biases fp64 [2I], down biases fp64 [H] or None)``, or None without biases (a TP
    slice's gate_up bias with its slice, a down bias where the slice adds it; with ``shards``
    > 1, the first slice adds it); ``in_model_dtype``: the activation computed in the model
    dtype (``_activated``).

    y is the sum of the TP slices' partial outputs (``_down_parts``), each computed once. The
    slack includes the rounding of each output to the model dtype: every TP slice's partial
    output rounds on its own (``shards``), and a biased one rounds again after its bias is added
    (see the module's "Output roundings")."""
    counts = [x.shape[0] for x in xs]
    M = sum(counts)
    if M == 0:
        return [(x.new_zeros(0, w2.shape[0]), x.new_zeros(0, w2.shape[0]) if with_slack else None)
                for x, w2 in zip(xs, w2s, strict=True)]
    dev = xs[0].device  # the group index lives beside the rows (scatter_reduce needs one device)
    group = torch.repeat_interleave(torch.arange(len(xs), device=dev), torch.tensor(counts, device=dev))
    exact = torch.cat([x @ w13.T for x, w13 in zip(xs, w13s, strict=True)])
    b13 = None if biases is None else torch.cat([b.expand(n, -1) for b, n in zip(biases[0], counts, strict=True)])
    b2s = [None] * len(xs) if biases is None else biases[1]

    def down(parts: list[torch.Tensor], b2: torch.Tensor | None) -> torch.Tensor:
        y = parts[0] if len(parts) == 1 else torch.stack(parts).sum(dim=0)
        return y if b2 is None else y + b2

    h = _activated(exact, activation, dtype, b13, in_model_dtype)
    if not with_slack:
        hq = _quantized_candidates([h], [h], group, len(xs), scheme, shards)[0] if scheme != "none" else h.double()
        return [(down(_down_parts(y, w2, shards), b2), None) for y, w2, b2 in zip(hq.split(counts), w2s, b2s, strict=True)]
    w13s_abs = [w.abs() for w in w13s] if abs_weights is None else abs_weights[0]
    w2s_abs = [w.abs() for w in w2s] if abs_weights is None else abs_weights[1]
    delta = accumulation * torch.cat([x.abs() @ w13_abs.T for x, w13_abs in zip(xs, w13s_abs, strict=True)])
    I = w2s[0].shape[1]
    shifts = []
    # The corners of the error box: gate and up each shifted by -+ delta; an ungated kind's up
    # products alone by -+ delta (relu2 is monotone, so its extremes lie at the two ends).
    corners = ((-1, -1), (-1, 1), (1, -1), (1, 1)) if get_activation(activation).gated else ((-1, -1), (1, 1))
    for gate_sign, up_sign in corners:
        shift = delta.clone()
        shift[:, :I] *= gate_sign
        shift[:, I:] *= up_sign
        shifts.append(exact + shift)
    # fp32 holds every model-dtype value exactly, and every quantizer computes in fp32.
    stacked = torch.stack([h, *_activated(torch.cat(shifts), activation, dtype,
                                          None if b13 is None else b13.repeat(len(corners), 1),
                                          in_model_dtype).split(M)]).float()
    lo, hi = stacked.amin(dim=0), stacked.amax(dim=0)
    if scheme == "none":
        # Unquantized h has no scales whose groups could flip: its candidates are lo and hi alone.
        hq = h.double()
        doubt = torch.maximum((lo.double() - hq).abs(), (hi.double() - hq).abs())
    else:
        # Scales depend on magnitudes only (every amax is of |values|), so the smallest- and
        # largest-magnitude candidates' scales are those of their magnitudes.
        magnitude = stacked.abs()
        small, large = magnitude.amin(dim=0), magnitude.amax(dim=0)
        hq, *candidates = _quantized_candidates([h, lo, lo, hi, hi], [h, small, large, small, large],
                                                group, len(xs), scheme, shards)
        doubt = torch.stack(candidates).sub_(hq).abs_().amax(dim=0)
    out = []
    for hq_g, doubt_g, w2, w2_abs, b2 in zip(hq.split(counts), doubt.split(counts), w2s, w2s_abs, b2s, strict=True):
        parts = _down_parts(hq_g, w2, shards)
        slack = doubt_g @ w2_abs.T + accumulation * (hq_g.abs() @ w2_abs.T)
        out.append((down(parts, b2), slack + _output_rounding(parts, b2, slack, unit_roundoff(dtype))))
    return out


def _down_parts(hq: torch.Tensor, w2: torch.Tensor, shards: int) -> list[torch.Tensor]:
    """The down GEMM's partial outputs, one per TP slice: ``shards`` fp64 [R, H].

    hq: fp64 [R, I] h as the down GEMM reads it; w2: fp64 [H, I]. Slice s multiplies the s-th
    of ``shards`` column chunks of I (a TP rank's); their sum is the whole product."""
    if shards == 1:
        return [hq @ w2.T]
    return [hq_s @ w2_s.T for hq_s, w2_s in zip(hq.chunk(shards, dim=1), w2.chunk(shards, dim=1), strict=True)]


def _output_rounding(parts: list[torch.Tensor], b2: torch.Tensor | None, slack: torch.Tensor,
                     u: float) -> torch.Tensor:
    """What rounding its output to the model dtype may move one expert's rows by: fp64 [R, H].

    parts: the TP slices' partial sums p_s (``_down_parts``), fp64 [R, H] each; b2: fp64 [H] or
    None; slack: fp64 [R, H] how far the kernel's own sum may be from the reference's; u: the
    model dtype's unit roundoff. Each slice rounds its partial sum (TP ranks), the first slice's
    again after adding the bias: at most u (sum_s |p_s| + slack), plus u (|p_0 + b2| + slack +
    that)."""
    first = parts[0]
    partial = first.abs() if len(parts) == 1 else torch.stack(parts).abs().sum(dim=0)
    rounding = u * (partial + slack)
    if b2 is not None:
        rounding = rounding + u * ((first + b2).abs() + slack + rounding)
    return rounding


def expert_rows(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, activation: str, dtype: torch.dtype,
                scheme: str, shards: int = 1, accumulation: float = ACCUMULATION["fp32"]) -> tuple[torch.Tensor, torch.Tensor]:
    """One expert's rows with the layer's roundings, and their slack.

    x: fp64 [R, H] the rows as the expert sees them (dequantized); w13: fp64 [2I, H] gate and
    up rows ([I, H] up rows for an ungated activation); w2: fp64 [H, I]; shards: TP slices of I
    quantized separately; accumulation: relative accumulation error of the kernel's sums, as a
    fraction of sum |a| |b| (``ACCUMULATION``).
    Returns (y, slack), both fp64 [R, H], unweighted.

    The candidates of h: the four corners of the error box (gate and up each shifted by -+
    delta; an ungated kind's two ends, up shifted by -+ delta). Every element may take any value
    between their smallest and largest (lo, hi), and every scale group any amax between the one
    its smallest-magnitude candidates give and the one its largest give; quantizing lo and hi
    with each of those two sets of scales gives the extreme outcomes of every element's rounding
    (rounding is monotone in value / scale).
    """
    y, slack = expert_rows_batched([x], [w13], [w2], activation, dtype, scheme, shards, accumulation)[0]
    assert slack is not None  # with_slack defaults to True, so the slack is computed
    return y, slack


def expert_reference(x: torch.Tensor | QuantizedActivations, expert_ids: torch.Tensor, weights: ExpertWeights,
                     activation: str, dtype: torch.dtype, accumulation: float = ACCUMULATION["fp32"]) -> Reference:
    """The routed experts alone: row m of ``x`` ([M, H], model dtype or quantized) through expert
    ``expert_ids[m]`` of ``weights`` (per-tensor scales of h per expert), unweighted -> fp64 [M, H]."""
    scheme = weights.scheme
    xa = x.dequantize(torch.float32).double() if isinstance(x, QuantizedActivations) else x.double()
    # Quantized schemes hold QuantizedWeight, "none" model-dtype tensors (ExpertWeights).
    w13 = (weights.gate_up.dequantize() if isinstance(weights.gate_up, QuantizedWeight) else weights.gate_up).double()
    w2 = (weights.down.dequantize() if isinstance(weights.down, QuantizedWeight) else weights.down).double()
    out = torch.zeros(expert_ids.shape[0], w2.shape[1], dtype=torch.float64, device=expert_ids.device)
    slack = torch.zeros_like(out)
    experts = [e for e in range(w13.shape[0]) if bool((expert_ids == e).any())]
    rows = [(expert_ids == e).nonzero().flatten() for e in experts]
    b13, b2 = weights.gate_up_bias, weights.down_bias
    biases = None
    if b13 is not None or b2 is not None:
        biases = ([torch.zeros(w13.shape[1], dtype=torch.float64) if b13 is None else b13[e].double() for e in experts],
                  [None if b2 is None else b2[e].double() for e in experts])
    results = expert_rows_batched([xa[r] for r in rows], [w13[e] for e in experts], [w2[e] for e in experts],
                                  activation, dtype, scheme, accumulation=accumulation, biases=biases)
    for r, (y, s) in zip(rows, results, strict=True):
        assert s is not None  # with_slack defaults to True, so the slack is computed
        out[r], slack[r] = y, s
    return Reference(out, slack)


# The largest accumulation error a caller may claim, relative to sum |a| |b|: far above any
# kernel's (``numerics.ACCUMULATION``), low enough that the slack it buys cannot pass everything.
MAX_ACCUMULATION = 2.0**-4


def _check_arguments(x, weights, cfg, quant, intermediate_shards, input_amax, accumulation, experts,
                     with_slack) -> None:
    """ValueError naming the argument and its value for anything ``reference_forward`` cannot
    take as documented: a wrong kind of object, shape or dtype, a count or bound out of range."""
    where = "reference_forward"
    if not isinstance(cfg, MoEConfig):
        raise ValueError(f"{where}: cfg must be a MoEConfig, got {type(cfg).__qualname__}")
    if not isinstance(weights, MoEWeights):
        raise ValueError(f"{where}: weights must be MoEWeights, got {type(weights).__qualname__}")
    if quant is not None and not isinstance(quant, QuantConfig):
        raise ValueError(f"{where}: quant must be a QuantConfig or None, got {quant!r} (write QuantConfig({quant!r}))")
    if quant is not None:
        quant.check_model(cfg, where)
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{where}: x must be a torch.Tensor [T, hidden_size={cfg.hidden_size}], got "
                         f"{type(x).__module__}.{type(x).__qualname__} (convert it with torch.as_tensor first)")
    if x.dim() != 2 or x.shape[1] != cfg.hidden_size:
        raise ValueError(f"{where}: x must be [T, hidden_size={cfg.hidden_size}], got {tuple(x.shape)}")
    if x.dtype != cfg.dtype:
        # The layer refuses it too: the router and the experts' rounding follow the model dtype,
        # so x in another dtype would give a reference that no layer computes.
        raise ValueError(f"{where}: x must be in the model dtype cfg.dtype={cfg.dtype}, got {x.dtype}")
    size(where, "intermediate_shards", intermediate_shards)
    if cfg.intermediate_size % intermediate_shards:
        raise ValueError(f"{where}: intermediate_shards={intermediate_shards} does not divide "
                         f"intermediate_size={cfg.intermediate_size}")
    finite_float(where, "accumulation", accumulation, 0.0, MAX_ACCUMULATION)
    if input_amax is not None:
        if not isinstance(input_amax, torch.Tensor) or input_amax.numel() != 1:
            raise ValueError(f"{where}: input_amax must be a one-element tensor (fp32 []) or None, got {input_amax!r}")
        amax = float(input_amax)
        if not math.isfinite(amax) or amax < 0:
            raise ValueError(f"{where}: input_amax must be finite and >= 0 (an amax), got {amax!r}")
    if experts is not None and not isinstance(experts, DequantizedExperts):
        raise ValueError(f"{where}: experts must be DequantizedExperts or None, got {type(experts).__qualname__}")
    boolean(where, "with_slack", with_slack)


def reference_forward(x: torch.Tensor, weights: MoEWeights, cfg: MoEConfig, quant: QuantConfig | None = None,
                      intermediate_shards: int = 1, input_amax: torch.Tensor | None = None,
                      accumulation: float = ACCUMULATION["fp32"], experts: DequantizedExperts | None = None,
                      with_slack: bool = True) -> Reference:
    """x: [T, H] in ``cfg.dtype`` (the domain's tokens) -> ``Reference`` of [T, H] on x's device.

    weights: full weights (any device); intermediate_shards: number of TP slices of I (1 under
    EP); input_amax: fp32 [] amax of the quantization domain (default: amax of x);
    accumulation: the expert kernel's accumulation error (``MoELayer.accumulation``);
    experts: ``DequantizedExperts.of(weights, quant.scheme, cfg.dtype)`` when the caller keeps
    one for several calls (default: made here); with_slack=False: the output alone (the slack
    is returned as zeros), e.g. for the quantization error against the unquantized layer.
    """
    _check_arguments(x, weights, cfg, quant, intermediate_shards, input_amax, accumulation, experts, with_slack)
    quant = quant or QuantConfig()
    scheme, dtype = quant.scheme, cfg.dtype
    if experts is not None and experts.scheme != scheme:
        raise ValueError(f"reference_forward: experts were dequantized from {experts.scheme!r}, quant is {scheme!r}")
    T, H = x.shape
    bias = None if weights.correction_bias is None else weights.correction_bias.to(x.device)
    router_bias = None if weights.gate_bias is None else weights.gate_bias.to(x.device)
    routing = route_tokens(x, weights.router_weight.to(x.device), cfg, bias, router_bias)
    tokens = x  # the rows the experts see: the tokens, or with weights on the input one row per (token, k)
    if cfg.routing_kind.weights_on_input:
        tokens, routing = weighted_rows(x, routing, dtype)
    if _per_tensor(scheme) and input_amax is None:
        input_amax = tokens.abs().amax().float() if tokens.numel() else torch.zeros((), device=x.device)
    xq = _fake_quant(tokens, scheme, input_amax)
    out = torch.zeros(tokens.shape[0], H, dtype=torch.float64, device=x.device)
    slack = torch.zeros_like(out)
    chosen: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # (expert, its tokens, their k), experts with rows
    for e in range(cfg.num_experts):
        tok, k = (routing.topk_ids == e).nonzero(as_tuple=True)
        if tok.numel():
            chosen.append((e, tok, k))
    ids = [e for e, _, _ in chosen]
    if experts is None:  # only the experts that receive rows
        experts, at = DequantizedExperts.of(weights, scheme, dtype, x.device, only=ids), list(range(len(ids)))
    else:
        at = ids
    on = (lambda w: [w[i] for i in at]) if experts.gate_up.device == x.device else \
        (lambda w: [w[i].to(x.device) for i in at])
    abs_weights = (on(experts.gate_up_abs), on(experts.down_abs)) if with_slack else None
    biases = None
    if experts.gate_up_bias is not None and experts.down_bias is not None:
        biases = (on(experts.gate_up_bias), on(experts.down_bias))
    results = expert_rows_batched([xq[tok] for _, tok, _ in chosen], on(experts.gate_up), on(experts.down),
                                  cfg.activation, dtype, scheme, intermediate_shards, accumulation, with_slack,
                                  abs_weights, biases)
    for (_, tok, k), (y, s) in zip(chosen, results, strict=True):  # in expert order, as a loop over experts adds them
        w = routing.topk_weights[tok, k].double().unsqueeze(1)
        out[tok] += y * w  # tok has no repeats for one expert
        if with_slack:
            assert s is not None  # computed when with_slack
            slack[tok] += s * w.abs()
    if cfg.routing_kind.weights_on_input:  # a token's K rows, summed
        out, slack = out.view(T, cfg.top_k, H).sum(dim=1), slack.view(T, cfg.top_k, H).sum(dim=1)
    if cfg.has_shared_experts:
        shared = shared_reference(x, weights, cfg, quant.shared, accumulation, with_slack)
        out += shared.out
        slack += shared.slack
    return Reference(out, slack)


def shared_reference(x: torch.Tensor, weights: MoEWeights, cfg: MoEConfig, scheme: str = "none",
                     accumulation: float = ACCUMULATION["fp32"], with_slack: bool = True) -> Reference:
    """The shared experts' contribution to the layer's output, as the layer computes it, and its
    slack: x [T, H] in ``cfg.dtype`` -> ``Reference`` of fp64 [T, H] on x's device.

    weights: full weights holding the shared MLP (and ``shared_expert_gate`` when configured);
    scheme: ``QuantConfig.shared``; accumulation: the accumulation error of the expert kernel
    that runs quantized shared experts. Unquantized, the MLP runs on torch's model-dtype matmul
    (fp32 accumulators, ``ACCUMULATION["fp32"]``) and its activation in the model dtype
    (``_activated``'s ``in_model_dtype``). The gate's and ``shared_scale``'s model-dtype
    operations are priced in the slack (see the module's "Output roundings")."""
    dtype = cfg.dtype
    x64 = x.double()
    # rounded to the model dtype first, as the layer holds them
    sw = {name: getattr(weights, name).to(dtype=dtype).to(x.device, torch.float64)
          for name in ("shared_gate", "shared_up", "shared_down", "shared_expert_gate") if getattr(weights, name) is not None}
    if scheme == "none":
        gate_up = torch.cat([sw["shared_gate"], sw["shared_up"]])
        [(y, s)] = expert_rows_batched([x64], [gate_up], [sw["shared_down"]], cfg.shared_act, dtype, "none", 1,
                                       ACCUMULATION["fp32"], with_slack, in_model_dtype=True)
    else:
        y, s = _quantized_shared(x, sw, cfg, scheme, accumulation, with_slack)
    slack = torch.zeros_like(y) if s is None else s
    u = unit_roundoff(dtype)
    if "shared_expert_gate" in sw:
        # z = x @ w_gate (a model-dtype linear), sigmoid(z), sigmoid(z) * y: each rounds.
        z = x64 @ sw["shared_expert_gate"].T
        sigma = torch.sigmoid(z)
        if with_slack:
            dz = u * z.abs() + (1 + u) * ACCUMULATION["fp32"] * (x64.abs() @ sw["shared_expert_gate"].abs().T)
            dsigma = 0.25 * dz + u * (sigma + 0.25 * dz)  # sigmoid is 1/4-Lipschitz, then rounds
            reach = y.abs() + slack
            slack = dsigma * reach + sigma * slack + u * (sigma + dsigma) * reach
        y = sigma * y
    if cfg.shared_scale != 1.0:  # the layer multiplies in the model dtype
        if with_slack:
            slack = cfg.shared_scale * slack + u * cfg.shared_scale * (y.abs() + slack)
        y = y * cfg.shared_scale
    return Reference(y, slack)


def _quantized_shared(x: torch.Tensor, sw: dict[str, torch.Tensor], cfg: MoEConfig, scheme: str, accumulation: float,
                      with_slack: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The shared MLP quantized with ``scheme`` (``QuantConfig.shared``, per-row or per-block
    activation scales), as ``moeshard.experts.shared`` runs it: one expert of gate_up [gate; up]
    and down, quantized like a routed expert, every row of x [T, H] through it. sw: the shared
    weights in fp64 (model-dtype values). -> (fp64 [T, H] output, fp64 [T, H] slack or None)."""
    def dequantized(w: torch.Tensor) -> torch.Tensor:
        return quantize_weight(w.unsqueeze(0).to(cfg.dtype), scheme).dequantize(torch.float32).double()[0]
    gate_up = dequantized(torch.cat([sw["shared_gate"], sw["shared_up"]]))
    down = dequantized(sw["shared_down"])
    abs_weights = ([gate_up.abs()], [down.abs()]) if with_slack else None
    [(y, s)] = expert_rows_batched([_fake_quant(x, scheme, None)], [gate_up], [down], cfg.shared_act, cfg.dtype,
                                   scheme, 1, accumulation, with_slack, abs_weights, None)
    return y, s
