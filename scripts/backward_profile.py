"""GPU time per kernel of the experts' training forward + backward, against the plain
``torch._grouped_mm`` autograd baseline on the same rows (what ``moeshard bench --backward``
times as a whole): where the backward's time goes.

    PYTHONPATH=src python3 scripts/backward_profile.py --models qwen3-30b-a3b,mixtral-8x7b --tokens 4096
"""

from __future__ import annotations

import argparse

import torch

from moeshard.bench.backward import _experts_fns, _grouped_mm_fns, _layer_fns
from moeshard.bench.timing import kernel_times
from moeshard.bench.workload import hidden_states, make_model, routed_input
from moeshard.config import QuantConfig


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="qwen3-30b-a3b,mixtral-8x7b")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--layer", action="store_true", help="also the whole layer's forward + backward (local backend)")
    args = p.parse_args()
    device = torch.device("cuda")
    for name in args.models.split(","):
        model = make_model(name, device)
        cfg = model.cfg
        inp, _ = routed_input(model, hidden_states(model, args.tokens, args.tokens), QuantConfig("none"))
        for label, fns in (("moeshard GroupedExperts", _experts_fns(model.gate_up, model.down, inp, cfg.activation,
                                                                    cfg.dtype, 0)),
                           ("torch._grouped_mm autograd", _grouped_mm_fns(model.gate_up, model.down, inp,
                                                                          cfg.num_experts, cfg.activation, cfg.dtype, 0))):
            with torch.enable_grad():
                rows = kernel_times(fns[1])
            print(f"== {name}, {args.tokens} tokens, {label}: forward + backward, GPU us per call "
                  f"(total {sum(us for _, us in rows):.0f})")
            for kernel, us in rows[:16]:
                print(f"  {us:10.1f} us  {kernel[:110]}")
        if args.layer:
            _, both, _ = _layer_fns(model, args.tokens, device, 0)
            with torch.enable_grad():
                rows = kernel_times(both)
            print(f"== {name}, {args.tokens} tokens, MoELayer: forward + backward, GPU us per call "
                  f"(total {sum(us for _, us in rows):.0f})")
            for kernel, us in rows[:24]:
                print(f"  {us:10.1f} us  {kernel[:110]}")
            del both
        del model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
