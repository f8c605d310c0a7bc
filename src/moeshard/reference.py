"""The single-device reference: a plain loop over experts in fp64.

It uses the same dequantized weights as the layer and quantizes activations exactly as the layer
does (same quantization functions, same grouping), so parallel and kernel errors can be told
apart from quantization error and tolerances stay tight:

* input activations: one domain for per-tensor scales (``input_amax``, default: amax of ``x``);
* the intermediate h = act(gate) * up is rounded to the model dtype as the layer's GEMM output
  is, split into ``intermediate_shards`` column slices (the TP slices of I), and each slice is
  quantized with per-tensor scales taken per expert over that expert's rows.

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

``quantization_error`` compares the quantized and unquantized references separately.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moeshard.config import MoEConfig, QuantConfig
from moeshard.experts.base import ExpertWeights, activate
from moeshard.numerics import ACCUMULATION, Reference
from moeshard.quant import QuantizedActivations, fake_quantize_activations, get_scheme, quantize_weight
from moeshard.router import route, router_logits
from moeshard.weights import MoEWeights

__all__ = ["Reference", "expert_reference", "expert_rows", "reference_forward"]


def _per_tensor(scheme: str) -> bool:
    return get_scheme(scheme, "reference: quant").per_tensor_activation


def _expert(w: torch.Tensor, e: int, scheme: str, device: torch.device) -> torch.Tensor:
    """fp64 [N, K]: expert ``e`` of ``w`` [E, N, K] as the layer sees it (quantized, dequantized).

    Every scheme's scales are per expert, so quantizing one expert alone gives exactly its part
    of the whole tensor's quantization; only experts that receive rows are ever materialised."""
    w = w[e:e + 1].to(device)
    if scheme != "none":
        w = quantize_weight(w, scheme).dequantize(torch.float32)
    return w[0].double()


def _fake_quant(x: torch.Tensor, scheme: str, amax: torch.Tensor | None,
                scales_from: torch.Tensor | None = None) -> torch.Tensor:
    if scheme == "none":
        return x.double()
    return fake_quantize_activations(x, scheme, amax=amax if _per_tensor(scheme) else None,
                                     scales_from=scales_from).double()


def _activated(gate_up: torch.Tensor, activation: str, dtype: torch.dtype) -> torch.Tensor:
    """fp64 gate_up sums [R, 2I] -> h = act(gate) * up [R, I] in ``dtype``, each factor rounded
    to ``dtype`` first, as the layer's GEMM epilogue rounds them."""
    return activate(gate_up.to(dtype), activation, dtype)


def _quantized(h: torch.Tensor, scheme: str, shards: int, scales_from: torch.Tensor | None = None) -> torch.Tensor:
    """h [R, I] in the model dtype -> fp64 [R, I] quantized per TP slice of I as the layer does
    (per-tensor scales over the slice), with the scales of ``scales_from`` (h's shape) if given."""
    I = h.shape[1]
    width = I // shards
    out = torch.empty(h.shape, dtype=torch.float64, device=h.device)
    for s in range(shards):
        cols = slice(s * width, (s + 1) * width)
        source = h[:, cols] if scales_from is None else scales_from[:, cols]
        amax = source.abs().amax().float() if _per_tensor(scheme) else None
        out[:, cols] = _fake_quant(h[:, cols], scheme, amax, None if scales_from is None else source)
    return out


def expert_rows(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, activation: str, dtype: torch.dtype,
                scheme: str, shards: int = 1, accumulation: float = ACCUMULATION["fp32"]) -> tuple[torch.Tensor, torch.Tensor]:
    """One expert's rows with the layer's roundings, and their slack.

    x: fp64 [R, H] the rows as the expert sees them (dequantized); w13: fp64 [2I, H] gate and up
    rows; w2: fp64 [H, I]; shards: TP slices of I quantized separately; accumulation: relative
    accumulation error of the kernel's sums, as a fraction of sum |a| |b| (``ACCUMULATION``).
    Returns (y, slack), both fp64 [R, H], unweighted.

    The candidates of h: the four corners of the error box (gate and up each shifted by -+
    delta). Every element may take any value between their smallest and largest (lo, hi), and
    every scale group any amax between the one its smallest-magnitude candidates give and the
    one its largest give; quantizing lo and hi with each of those two sets of scales gives the
    extreme outcomes of every element's rounding (rounding is monotone in value / scale).
    """
    exact = x @ w13.T
    h = _activated(exact, activation, dtype)
    hq = _quantized(h, scheme, shards)
    delta = accumulation * (x.abs() @ w13.abs().T)
    I = w2.shape[1]
    corners = []
    for gate_sign, up_sign in ((-1, -1), (-1, 1), (1, -1), (1, 1)):
        shift = delta.clone()
        shift[:, :I] *= gate_sign
        shift[:, I:] *= up_sign
        corners.append(_activated(exact + shift, activation, dtype))
    stacked = torch.stack([h, *corners])
    lo, hi = stacked.amin(dim=0), stacked.amax(dim=0)
    magnitude = stacked.abs()
    small = stacked.gather(0, magnitude.argmin(dim=0, keepdim=True))[0]
    large = stacked.gather(0, magnitude.argmax(dim=0, keepdim=True))[0]
    doubt = torch.zeros_like(hq)
    # Unquantized h has no scales whose groups could flip: its candidates are lo and hi alone.
    for value in (lo, hi):
        for scales in ((small, large) if scheme != "none" else (None,)):
            doubt = torch.maximum(doubt, (_quantized(value, scheme, shards, scales) - hq).abs())
    w2_abs = w2.abs()
    slack = doubt @ w2_abs.T + accumulation * (hq.abs() @ w2_abs.T)
    return hq @ w2.T, slack


def expert_reference(x: torch.Tensor | QuantizedActivations, expert_ids: torch.Tensor, weights: ExpertWeights,
                     activation: str, dtype: torch.dtype, accumulation: float = ACCUMULATION["fp32"]) -> Reference:
    """The routed experts alone: row m of ``x`` ([M, H], model dtype or quantized) through expert
    ``expert_ids[m]`` of ``weights`` (per-tensor scales of h per expert), unweighted -> fp64 [M, H]."""
    scheme = weights.scheme
    xa = x.dequantize(torch.float32).double() if isinstance(x, QuantizedActivations) else x.double()
    w13 = (weights.gate_up.dequantize() if scheme != "none" else weights.gate_up).double()
    w2 = (weights.down.dequantize() if scheme != "none" else weights.down).double()
    out = torch.zeros(expert_ids.shape[0], w2.shape[1], dtype=torch.float64, device=expert_ids.device)
    slack = torch.zeros_like(out)
    for e in range(w13.shape[0]):
        rows = (expert_ids == e).nonzero().flatten()
        if rows.numel():
            out[rows], slack[rows] = expert_rows(xa[rows], w13[e], w2[e], activation, dtype, scheme,
                                                 accumulation=accumulation)
    return Reference(out, slack)


def reference_forward(x: torch.Tensor, weights: MoEWeights, cfg: MoEConfig, quant: QuantConfig | None = None,
                      intermediate_shards: int = 1, input_amax: torch.Tensor | None = None,
                      accumulation: float = ACCUMULATION["fp32"]) -> Reference:
    """x: [T, H] in ``cfg.dtype`` (the domain's tokens) -> ``Reference`` of [T, H] on x's device.

    weights: full weights (any device); intermediate_shards: number of TP slices of I (1 under
    EP); input_amax: fp32 [] amax of the quantization domain (default: amax of x);
    accumulation: the expert kernel's accumulation error (``MoELayer.accumulation``).
    """
    quant = quant or QuantConfig()
    scheme, dtype = quant.scheme, cfg.dtype
    weights = weights.to(dtype=dtype)  # stays where it is; each expert travels to x's device when used
    T, H = x.shape
    bias = None if weights.correction_bias is None else weights.correction_bias.to(x.device)
    routing = route(router_logits(x, weights.gate.to(x.device)), cfg, bias)
    if _per_tensor(scheme) and input_amax is None:
        input_amax = x.abs().amax().float() if x.numel() else torch.zeros((), device=x.device)
    xq = _fake_quant(x, scheme, input_amax)
    out = torch.zeros(T, H, dtype=torch.float64, device=x.device)
    slack = torch.zeros_like(out)
    for e in range(cfg.num_experts):
        tok, k = (routing.topk_ids == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        y, s = expert_rows(xq[tok], _expert(weights.gate_up, e, scheme, x.device),
                           _expert(weights.down, e, scheme, x.device), cfg.activation, dtype, scheme,
                           intermediate_shards, accumulation)
        w = routing.topk_weights[tok, k].double().unsqueeze(1)
        out[tok] += y * w  # tok has no repeats for one expert
        slack[tok] += s * w.abs()
    if cfg.has_shared_experts:
        x64 = x.double()
        w = {name: getattr(weights, name).to(x.device, torch.float64)
             for name in ("shared_gate", "shared_up", "shared_down", "shared_expert_gate") if getattr(weights, name) is not None}
        act = F.silu if cfg.activation == "silu" else F.gelu
        shared = (act(x64 @ w["shared_gate"].T) * (x64 @ w["shared_up"].T)) @ w["shared_down"].T
        if "shared_expert_gate" in w:
            shared = torch.sigmoid(x64 @ w["shared_expert_gate"].T) * shared
        out += shared
    return Reference(out, slack)
