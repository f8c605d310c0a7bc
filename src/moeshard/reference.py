"""The single-device reference: a plain loop over experts in fp64.

It uses the same dequantized weights as the layer and quantizes activations exactly as the layer
does (same quantization functions, same grouping), so parallel and kernel errors can be told
apart from quantization error and tolerances stay tight:

* input activations: one domain for per-tensor scales (``input_amax``, default: amax of ``x``);
* the intermediate h = act(gate) * up is rounded to the model dtype as the layer's GEMM output
  is, split into ``intermediate_shards`` column slices (the TP slices of I), and each slice is
  quantized with per-tensor scales taken per expert over that expert's rows.

``quantization_error`` compares the quantized and unquantized references separately.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moeshard.config import MoEConfig, QuantConfig
from moeshard.experts.grouped import PER_TENSOR_SCHEMES, activate
from moeshard.quant import fake_quantize_activations, quantize_weight
from moeshard.router import route, router_logits
from moeshard.weights import MoEWeights


def _expert(w: torch.Tensor, e: int, scheme: str, device: torch.device) -> torch.Tensor:
    """fp64 [N, K]: expert ``e`` of ``w`` [E, N, K] as the layer sees it (quantized, dequantized).

    Every scheme's scales are per expert, so quantizing one expert alone gives exactly its part
    of the whole tensor's quantization; only experts that receive rows are ever materialised."""
    w = w[e:e + 1].to(device)
    if scheme != "none":
        w = quantize_weight(w, scheme).dequantize(torch.float32)
    return w[0].double()


def _fake_quant(x: torch.Tensor, scheme: str, amax: torch.Tensor | None) -> torch.Tensor:
    if scheme == "none":
        return x.double()
    return fake_quantize_activations(x, scheme, amax=amax if scheme in PER_TENSOR_SCHEMES else None).double()


def reference_forward(x: torch.Tensor, weights: MoEWeights, cfg: MoEConfig, quant: QuantConfig | None = None,
                      intermediate_shards: int = 1, input_amax: torch.Tensor | None = None) -> torch.Tensor:
    """x: [T, H] in ``cfg.dtype`` (the domain's tokens) -> fp64 [T, H] on x's device.

    weights: full weights (any device); intermediate_shards: number of TP slices of I (1 under
    EP); input_amax: fp32 [] amax of the quantization domain (default: amax of x).
    """
    quant = quant or QuantConfig()
    scheme, dtype = quant.scheme, cfg.dtype
    weights = weights.to(dtype=dtype)  # stays where it is; each expert travels to x's device when used
    T, H = x.shape
    bias = None if weights.correction_bias is None else weights.correction_bias.to(x.device)
    routing = route(router_logits(x, weights.gate.to(x.device)), cfg, bias)
    if scheme in PER_TENSOR_SCHEMES and input_amax is None:
        input_amax = x.abs().amax().float() if x.numel() else torch.zeros((), device=x.device)
    xq = _fake_quant(x, scheme, input_amax)
    out = torch.zeros(T, H, dtype=torch.float64, device=x.device)
    I = cfg.intermediate_size
    width = I // intermediate_shards
    for e in range(cfg.num_experts):
        tok, k = (routing.topk_ids == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        gate_up = (xq[tok] @ _expert(weights.gate_up, e, scheme, x.device).T).to(dtype)
        gate, up = gate_up[:, :I], gate_up[:, I:]
        h = torch.empty(tok.numel(), I, dtype=torch.float64, device=x.device)
        for s in range(intermediate_shards):
            cols = slice(s * width, (s + 1) * width)
            hs = activate(torch.cat([gate[:, cols], up[:, cols]], dim=1), cfg.activation, dtype)
            amax = hs.abs().amax().float() if scheme in PER_TENSOR_SCHEMES else None
            h[:, cols] = _fake_quant(hs, scheme, amax)
        y = h @ _expert(weights.down, e, scheme, x.device).T
        out[tok] += y * routing.topk_weights[tok, k].double().unsqueeze(1)  # tok has no repeats for one expert
    if cfg.has_shared_experts:
        x64 = x.double()
        w = {name: getattr(weights, name).to(x.device, torch.float64)
             for name in ("shared_gate", "shared_up", "shared_down", "shared_expert_gate") if getattr(weights, name) is not None}
        act = F.silu if cfg.activation == "silu" else F.gelu
        shared = (act(x64 @ w["shared_gate"].T) * (x64 @ w["shared_up"].T)) @ w["shared_down"].T
        if "shared_expert_gate" in w:
            shared = torch.sigmoid(x64 @ w["shared_expert_gate"].T) * shared
        out += shared
    return out
