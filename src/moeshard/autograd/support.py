"""What can be trained: ``backward_refusal`` says why a combination has no backward, or "".

=====================  ======================================================================
piece                  backward
=====================  ======================================================================
quant ``none``         yes: input, router, experts, shared experts (fp32, bf16, fp16 models)
fp8_tensor, fp8_token  refused, every quantized scheme alike: the experts are stored quantized
fp8_block, nvfp4       (there is no master weight to update) and the rounding of activations
                       has no gradient; no straight-through estimator is offered
backends               those whose registry entry says ``backward=True`` (every built-in one)
Triton expert kernels  forward only: a layer that needs gradients runs the portable
                       ``GroupedExperts`` instead (same results within the tolerance table)
load balancing         a placement with replicas is refused: a replica's gradient would have
                       to be summed with its expert's over the ranks holding them
=====================  ======================================================================
"""

from __future__ import annotations

from moeshard.config import QuantConfig
from moeshard.dispatch.registry import BACKENDS


def backward_refusal(backend: str, quant: QuantConfig, has_replicas: bool = False) -> str:
    """Why gradients cannot flow through ``backend`` with ``quant`` ("" when they can);
    has_replicas: the layer's load-balancing placement replicates an expert."""
    spec = BACKENDS.get(backend)
    if spec is None:
        return f"unknown backend {backend!r}; known: {sorted(BACKENDS)}"
    if quant.quantized:
        return (f"quant {quant.scheme!r} has no backward: its experts are stored quantized (no master weights to "
                f"update) and the rounding of activations has no gradient; train with quant 'none'")
    if not spec.backward:
        return f"backend {backend!r} has no backward (its registry entry says backward=False)"
    if has_replicas:
        return ("a load-balancing placement with replicas has no backward: a replica's gradient would have to be "
                "summed with its expert's over their ranks; train with a placement without replicas")
    return ""
