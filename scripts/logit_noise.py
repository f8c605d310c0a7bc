"""How far float32 rounding alone moves a model's logits, on each device, next to moeshard's distance.

    PYTHONPATH=src python3 scripts/logit_noise.py MODEL_DIR [--devices cpu,cuda] [--json PATH]

One teacher-forced forward over a fixed batch (two prompts of 16 ids, the second left-padded by
4, with its attention mask) through:

- transformers alone in float64 on the CPU: the exact logits, for scale;
- transformers alone in float32 on each device, with its default experts implementation (what
  ``moeshard generate --compare`` runs);
- moeshard at (1,1) (``load_sharded_model``, local backend) in float32 on each device.

Printed: each float32 run's largest |logits - float64 logits| over the unpadded positions, and
moeshard's largest distance from transformers on the same device, which is what
``moeshard generate --compare`` measures. When moeshard's distance from the exact logits is of the
order of transformers' own, the difference between the two is float32 rounding in different
orders (e.g. every expert on every token, weighted, against the selected experts only), not a
difference in what is computed.
"""

from __future__ import annotations

import argparse
import json

import torch


def batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, vocab, (2, 16), generator=gen)
    mask = torch.ones_like(ids)
    ids[1, :4], mask[1, :4] = 0, 0
    return ids, mask


def logits(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """float64 [B, S, V] on the CPU, zero at padded positions."""
    device = next(model.parameters()).device
    with torch.no_grad():
        out = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits
    return out.double().cpu() * mask.unsqueeze(-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir")
    parser.add_argument("--devices", default="cpu,cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    from moeshard.checkpoint.hf_model import load_transformers_model
    from moeshard.integrations.transformers import load_sharded_model

    def hf(dtype: torch.dtype, device: str) -> torch.nn.Module:
        return load_transformers_model(args.model_dir, dtype).to(device).eval()

    exact_model = hf(torch.float64, "cpu")  # the experts looped: torch._grouped_mm takes no float64
    ids, mask = batch(exact_model.config.vocab_size)
    exact = logits(exact_model, ids, mask)
    del exact_model
    rows = []
    for device in args.devices.split(","):
        ours = logits(load_sharded_model(args.model_dir, dtype=torch.float32, device=device), ids, mask)
        theirs = logits(hf(torch.float32, device), ids, mask)
        row = {"device": device, "max_abs_exact": float(exact.abs().max()),
               "transformers_vs_exact": float((theirs - exact).abs().max()),
               "moeshard_vs_exact": float((ours - exact).abs().max()),
               "moeshard_vs_transformers": float((ours - theirs).abs().max())}
        rows.append(row)
        print(f"{device}: max |logit| {row['max_abs_exact']:.3g}; float32 vs float64: transformers "
              f"{row['transformers_vs_exact']:.3g}, moeshard {row['moeshard_vs_exact']:.3g}; "
              f"moeshard vs transformers {row['moeshard_vs_transformers']:.3g}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model_dir": args.model_dir, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
