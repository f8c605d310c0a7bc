"""The shared experts in the model dtype against quantized (``QuantConfig.shared``), alone and in
the whole layer, at prefill.

For each model with shared experts, token count and routed scheme this times, on the bench's
workload (``moeshard.bench.workload``, CUDA graphs, an L2 flush before every repetition, the
variants in alternating rounds):
- ``shared_<s>``: the shared MLP alone on the tokens, in the model dtype (``none``: three
  cuBLAS GEMMs and the activation) or quantized with ``<s>`` (the input quantized, then the
  expert kernels' gate_up, ``quantize_h`` and down for one expert);
- ``layer_<s>``: the whole ``MoELayer`` with its shared experts so (on a side stream beside the
  routed path, as the layer runs them on CUDA);
- ``layer_serial_<s>``: the same layer with the side stream off (``overlap_shared``), so that the
  shared experts' time adds to the routed path's.
A record is written after every case.

    PYTHONPATH=src python3 scripts/shared_quant_study.py --json results/h200/shared_quant_study.json
"""

from __future__ import annotations

from moeshard.bench.study import case_line, run_on_gpu, study_parser, time_variants
from moeshard.bench.workload import experts_for, hidden_states
from moeshard.config import QuantConfig
from moeshard.layer import MoELayer

MODELS = ("deepseek-v3",)
TOKENS = (4096, 16384)
SCHEMES = ("fp8_tensor", "fp8_block")
SHARED = ("none", "fp8_block", "fp8_token")


def study(name: str, model, tokens: int, scheme: str, flush, args) -> dict:
    if not model.cfg.has_shared_experts:
        raise ValueError(f"{name}: no shared experts to study")
    experts = experts_for(model, scheme)
    x = hidden_states(model, tokens, tokens)
    calls = {}
    for shared in SHARED:
        layer = MoELayer(model.cfg, QuantConfig(scheme, shared=shared), weights=model.shell, local_experts=experts,
                         device=x.device)
        serial = MoELayer(model.cfg, QuantConfig(scheme, shared=shared), weights=model.shell, local_experts=experts,
                          device=x.device)
        serial.overlap_shared = False
        assert layer.shared_experts is not None
        calls[f"shared_{shared}"] = lambda mlp=layer.shared_experts: mlp(x)
        calls[f"layer_{shared}"] = lambda layer=layer: layer(x)
        calls[f"layer_serial_{shared}"] = lambda layer=serial: layer(x)
    rec = {"model": name, "tokens": tokens, "scheme": scheme}
    return time_variants(rec, calls, flush, args)


def main() -> None:
    run_on_gpu(study_parser(__doc__, MODELS, TOKENS, SCHEMES, reps=10).parse_args(), "scripts/shared_quant_study.py",
               study, case_line)


if __name__ == "__main__":
    main()
