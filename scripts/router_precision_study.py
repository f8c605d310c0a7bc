"""Router logits in the model dtype across devices, and how each device's torch.topk breaks ties.

    PYTHONPATH=src python3 scripts/router_precision_study.py [--tokens 16384] [--json PATH]

For every preset whose router computes in the model dtype (``router_dtype="model"``), at its
small and full sizes, in bfloat16, with a random router (``MoEWeights.random``'s: std 2/sqrt(H),
a selection bias in [0, 0.1), a router bias of std 0.5) and random tokens (std 1), the tokens
are routed by ``route_tokens`` on the CPU and (when there is one) on CUDA. Per preset and size it
counts, among the rows:

* ``tied``: rows whose K-th and (K+1)-th selection values are equal in bf16 (moeshard keeps the
  lower expert index; ``torch.topk`` breaks such a tie its own way);
* ``topk_cpu_lower`` / ``topk_cuda_lower``: of those, the rows where ``torch.topk`` of the same
  values on that device (as transformers selects) chose the set moeshard chose;
* ``logits_cpu_vs_cuda``: rows with a logit whose bits differ between the CPU's and CUDA's bf16
  product (the two accumulate in different orders, then round);
* ``ids_cpu_vs_cuda``: rows whose experts differ between the devices (what the verification
  matrix, whose reference routes on the CPU, would see of a CUDA layer);
* ``ids_fp32_vs_model``: rows whose experts differ between fp32 and model-dtype logits (CPU).

Where the values are selected on: the logits, or for a kind with a selection bias its scores
plus the bias; the grouped kinds are left out (their selection is not one top-k).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

import torch

from moeshard.presets import PRESETS
from moeshard.router import route_tokens


def _selected_on(logits: torch.Tensor, cfg, bias: torch.Tensor | None) -> torch.Tensor:
    if bias is None:
        return logits
    scores = logits.softmax(dim=-1) if cfg.routing_kind.scores == "softmax" else logits.sigmoid()
    return scores + bias.float().view(1, -1)


def _lower_index_set(values: torch.Tensor, k: int) -> torch.Tensor:
    return torch.sort(values, dim=-1, descending=True, stable=True).indices[:, :k].sort(dim=-1).values


def study(name: str, size: str, tokens: int, seed: int) -> dict:
    cfg = PRESETS[name].config(size, torch.bfloat16)
    g = torch.Generator().manual_seed(seed)
    E, H = cfg.num_experts, cfg.hidden_size
    # the router of MoEWeights.random (its experts are not needed here)
    gate = (torch.randn(E, H, generator=g) * 2 / H**0.5).to(torch.bfloat16)
    bias = torch.rand(E, generator=g) * 0.1 if cfg.use_correction_bias else None
    gate_bias = (torch.randn(E, generator=g) * 0.5).to(torch.bfloat16) if cfg.routing_kind.router_bias else None
    x = torch.randn(tokens, H, generator=g).to(torch.bfloat16)
    cpu = route_tokens(x, gate, cfg, bias, gate_bias)
    assert cpu.logits is not None
    values = _selected_on(cpu.logits, cfg, bias)
    ranked = values.sort(dim=-1, descending=True).values
    tied = ranked[:, cfg.top_k - 1] == ranked[:, cfg.top_k]
    mine = cpu.topk_ids.sort(dim=-1).values
    out = {"preset": name, "size": size, "E": cfg.num_experts, "K": cfg.top_k, "H": cfg.hidden_size,
           "rows": tokens, "tied": int(tied.sum())}
    assert torch.equal(mine, _lower_index_set(values, cfg.top_k))
    topk_cpu = values.topk(cfg.top_k, dim=-1).indices.sort(dim=-1).values
    out["topk_cpu_lower"] = int((topk_cpu == mine).all(dim=-1)[tied].sum())
    fp32 = route_tokens(x, gate, replace(cfg, router_dtype="fp32"), bias, gate_bias).topk_ids.sort(dim=-1).values
    out["ids_fp32_vs_model"] = int((fp32 != mine).any(dim=-1).sum())
    if torch.cuda.is_available():
        dev = torch.device("cuda")
        on = lambda t: None if t is None else t.to(dev)  # noqa: E731
        cuda = route_tokens(x.to(dev), gate.to(dev), cfg, on(bias), on(gate_bias))
        assert cuda.logits is not None
        out["logits_cpu_vs_cuda"] = int((cuda.logits.cpu() != cpu.logits).any(dim=-1).sum())
        out["ids_cpu_vs_cuda"] = int((cuda.topk_ids.sort(dim=-1).values.cpu() != mine).any(dim=-1).sum())
        topk_cuda = values.to(dev).topk(cfg.top_k, dim=-1).indices.sort(dim=-1).values.cpu()
        out["topk_cuda_lower"] = int((topk_cuda == mine).all(dim=-1)[tied].sum())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json")
    args = parser.parse_args()
    rows = []
    for name, preset in PRESETS.items():
        if preset.small.router_dtype != "model" or preset.small.n_group > 1:
            continue
        if preset.small.routing_kind.order == "masked_rounds":  # sparsemixer: K rounds of top-1
            continue
        for size in ("small", "full"):
            r = study(name, size, args.tokens, args.seed)
            rows.append(r)
            print(json.dumps(r), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tokens": args.tokens, "seed": args.seed, "torch": torch.__version__,
                       "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
