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


def _dequantized(w: torch.Tensor, scheme: str) -> torch.Tensor:
    if scheme == "none":
        return w.double()
    return quantize_weight(w, scheme).dequantize(torch.float32).double()


def _fake_quant(x: torch.Tensor, scheme: str, amax: torch.Tensor | None) -> torch.Tensor:
    if scheme == "none":
        return x.double()
    return fake_quantize_activations(x, scheme, amax=amax if scheme in PER_TENSOR_SCHEMES else None).double()


def reference_forward(x: torch.Tensor, weights: MoEWeights, cfg: MoEConfig, quant: QuantConfig | None = None,
                      intermediate_shards: int = 1, input_amax: torch.Tensor | None = None) -> torch.Tensor:
    """x: [T, H] in ``cfg.dtype`` (the domain's tokens) -> fp64 [T, H].

    weights: full weights; intermediate_shards: number of TP slices of I (1 under EP);
    input_amax: fp32 [] amax of the quantization domain (default: amax of x).
    """
    quant = quant or QuantConfig()
    scheme, dtype = quant.scheme, cfg.dtype
    weights = weights.to(dtype=dtype)
    T, H = x.shape
    routing = route(router_logits(x, weights.gate), cfg, weights.correction_bias)
    w13 = _dequantized(weights.gate_up, scheme)
    w2 = _dequantized(weights.down, scheme)
    if scheme in PER_TENSOR_SCHEMES and input_amax is None:
        input_amax = x.abs().amax().float() if x.numel() else torch.zeros(())
    xq = _fake_quant(x, scheme, input_amax)
    out = torch.zeros(T, H, dtype=torch.float64)
    I = cfg.intermediate_size
    width = I // intermediate_shards
    for e in range(cfg.num_experts):
        tok, k = (routing.topk_ids == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        gate_up = (xq[tok] @ w13[e].T).to(dtype)
        gate, up = gate_up[:, :I], gate_up[:, I:]
        h = torch.empty(tok.numel(), I, dtype=torch.float64)
        for s in range(intermediate_shards):
            cols = slice(s * width, (s + 1) * width)
            hs = activate(torch.cat([gate[:, cols], up[:, cols]], dim=1), cfg.activation, dtype)
            amax = hs.abs().amax().float() if scheme in PER_TENSOR_SCHEMES else None
            h[:, cols] = _fake_quant(hs, scheme, amax)
        y = h @ w2[e].T
        out[tok] += y * routing.topk_weights[tok, k].double().unsqueeze(1)  # tok has no repeats for one expert
    if cfg.has_shared_experts:
        x64 = x.double()
        act = F.silu if cfg.activation == "silu" else F.gelu
        shared = (act(x64 @ weights.shared_gate.double().T) * (x64 @ weights.shared_up.double().T)) @ weights.shared_down.double().T
        if weights.shared_expert_gate is not None:
            shared = torch.sigmoid(x64 @ weights.shared_expert_gate.double().T) * shared
        out += shared
    return out
