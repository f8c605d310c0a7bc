"""Where a decode step's layer time goes beyond its experts: the bench's layer against the same
layer with one stage taken away or run in line, at the bench's decode token counts.

    PYTHONPATH=src python3 scripts/decode_layer_study.py [--models ...] [--tokens 1,16,128]
        [--schemes fp8_tensor,fp8_block] [--rounds 3] [--reps 40] [--json FILE]

A kernel profile (``scripts/layer_profile.py``) sums each kernel's time; at decode the kernels
are short and wait on one another, so what a stage costs is what the layer loses or gains
without it. Variants, each captured in one CUDA graph after the bench's L2 flush and timed in
alternating rounds (``bench.study.time_variants``):

* ``layer``: ``MoELayer`` as ``moeshard bench`` builds it (the preset's full-size block, the
  bench's seeds, the routed experts quantized once and shared by every variant);
* ``shared_inline``: shared experts on the layer's stream, not a side stream (models with them);
* ``payload_inline``: a per-tensor scheme's amax and quantization at dispatch, not on a side
  stream beside the router (fp8_tensor, nvfp4);
* ``payload_priority``: the payload's side stream at the device's highest stream priority
  (per-tensor schemes of models with shared experts, whose side stream runs beside it);
* ``no_shared``: the same block without its shared experts (models with them): the routed path;
* ``routed_chain``: route, dispatch and the experts, no combine and no shared experts;
* ``route``: the router alone (logits, selection);
* ``experts``: the experts alone on the routed rows (the bench's "experts").

Every variant's output is checked to be the layer's bits where it computes the same thing
(``shared_inline``, ``payload_inline``).
"""

from __future__ import annotations

import dataclasses

import torch

from moeshard.bench.study import case_line, run_on_gpu, study_parser, time_variants
from moeshard.bench.workload import ModelOnDevice, experts_for, hidden_states, routed_input
from moeshard.config import QuantConfig
from moeshard.kernel_choice import select_kernel
from moeshard.layer import MoELayer

SCRIPT = "scripts/decode_layer_study.py"


def without_shared(model: ModelOnDevice) -> tuple:
    """(config, shell weights) of ``model``'s block without its shared experts."""
    cfg = dataclasses.replace(model.cfg, num_shared_experts=0, shared_intermediate_size=0, shared_expert_gate=False,
                              shared_scale=1.0)
    shell = dataclasses.replace(model.shell, shared_gate=None, shared_up=None, shared_down=None,
                                shared_expert_gate=None)
    return cfg, shell


def layers(model: ModelOnDevice, scheme: str, experts) -> dict[str, MoELayer]:
    """The variants' layers, sharing ``experts`` (the routed experts in ``scheme``)."""
    quant = QuantConfig(scheme)

    def build(cfg=model.cfg, shell=model.shell) -> MoELayer:
        return MoELayer(cfg, quant, weights=shell, local_experts=experts, device=model.gate_up.device)

    out = {"layer": build()}
    if model.cfg.has_shared_experts:
        out["shared_inline"] = build()
        out["shared_inline"].overlap_shared = False
        cfg, shell = without_shared(model)
        out["no_shared"] = build(cfg, shell)
    if quant.spec.per_tensor_activation:
        out["payload_inline"] = build()
        out["payload_inline"].overlap_payload = False
        if model.cfg.has_shared_experts and model.gate_up.device.type == "cuda":
            # The payload's side stream at the highest priority the device has (the layer's own
            # side streams take the default, lowest): the payload against the shared experts.
            out["payload_priority"] = build()
            # (torch maps a priority past the device's range to its nearest end: the highest.)
            out["payload_priority"]._streams["payload"] = torch.cuda.Stream(model.gate_up.device, priority=-100)
    return out


def study(name: str, model: ModelOnDevice, tokens: int, scheme: str, flush, args) -> dict:
    experts = experts_for(model, scheme)
    kernel = select_kernel(model.cfg.activation, model.cfg.dtype, model.gate_up.device, scheme)
    variants = layers(model, scheme, experts)
    x = hidden_states(model, tokens, tokens)  # the bench's tokens for this count (seed 0 + tokens)
    inp, _ = routed_input(model, x, QuantConfig(scheme))
    main = variants["layer"]
    want = main(x)
    rec = {"model": name, "tokens": tokens, "scheme": scheme,
           "same_bits": {k: torch.equal(v(x), want) for k, v in variants.items() if k.endswith("_inline")}}
    calls = {k: (lambda layer=v: layer(x)) for k, v in variants.items()}
    calls["routed_chain"] = lambda: kernel(main.backend.dispatch(x, main.route(x)).input, experts)
    calls["route"] = lambda: main.route(x)
    calls["experts"] = lambda: kernel(inp, experts)
    return time_variants(rec, calls, flush, args)


def line(rec: dict) -> str:
    bits = " ".join(f"{k}:{'same' if v else 'DIFFERENT'}" for k, v in rec["same_bits"].items())
    return case_line(rec) + (f" | bits {bits}" if bits else "")


def main() -> None:
    args = study_parser(__doc__, ("deepseek-v3", "qwen3-30b-a3b", "mixtral-8x7b"), (1, 16, 128),
                        ("fp8_tensor", "fp8_block"), reps=40).parse_args()
    run_on_gpu(args, SCRIPT, study, line)


if __name__ == "__main__":
    main()
