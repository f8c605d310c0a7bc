"""What empty picks save: LongCat-Flash's block on one GPU, its zero-computation picks run as empty
picks (id -1, no expert computes them) against the way they ran before, as expert 0 with weight 0.

    PYTHONPATH=src python3 scripts/empty_picks_study.py [--experts 256] [--tokens 16,128,4096,16384] \\
        [--rounds 2] [--reps 10] [--json OUT.json]

The block is LongCat-Flash's shape (H 6144, expert I 2048, top-12 of E routed and E / 2
zero-computation experts, bf16, random weights std 1/sqrt(fan_in)) with ``--experts`` routed
experts; each token's 12 picks are drawn uniformly without repeats from the E + E / 2, so about a
third are zero-computation, as in the model. Both variants run ``MoEExperts`` on the Triton
kernels, captured in a CUDA graph, the bench's L2 flush before each repetition, alternating
rounds (``moeshard.bench.timing.alternating_medians``):

- ``empty``: ``MoEExperts(identity_experts=E / 2)``, the layer as it is;
- ``zeroed``: the same layer with the local backend's ``combine_skips_empty`` off while it is
  captured, so the layer zeroes the empty picks' rows of the experts' output in a pass of its own
  before the combine (what that flag saves);
- ``expert0``: the same weights in ``MoEExperts()``, given each zero-computation pick as expert 0
  with weight 0, and the zero-computation term added after it, as the layer did before empty picks.

All give the same output (checked first, within one bf16 step of the output's scale). Prints a
table of median ms and the ratios expert0 / empty and zeroed / empty; ``--json`` writes it with the
device and the command.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from moeshard.bench.timing import L2Flush, alternating_medians  # noqa: E402
from moeshard.bench.workload import _randn  # noqa: E402
from moeshard.config import MoEConfig  # noqa: E402
from moeshard.dispatch.registry import BACKENDS  # noqa: E402
from moeshard.integrations.given_routing import MoEExperts  # noqa: E402
from moeshard.weights import MoEWeights  # noqa: E402

H, I, K = 6144, 2048, 12


def picks(tokens: int, experts: int, zero: int, gen: torch.Generator, device: torch.device):
    """ids int64 [T, K] distinct per token in [0, E + Z), weights fp32 [T, K] in (0, 1)."""
    ids = torch.rand(tokens, experts + zero, generator=gen, device=device).argsort(dim=1)[:, :K]
    weights = torch.rand(tokens, K, generator=gen, device=device) * 0.5 + 0.05
    return ids, weights


@contextlib.contextmanager
def zeroing_layer():
    """The local backend declared without ``combine_skips_empty`` inside the block: a forward run
    (or captured) there zeroes the empty picks' rows in the layer before the combine."""
    spec = BACKENDS["local"]
    BACKENDS["local"] = dataclasses.replace(spec, combine_skips_empty=False)
    try:
        yield
    finally:
        BACKENDS["local"] = spec


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--experts", type=int, default=256,
                   help="routed experts (LongCat-Flash has 512; three copies of theirs fit an H200, not an H100)")
    p.add_argument("--tokens", default="16,128,4096,16384")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("empty_picks_study: needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    E, Z = args.experts, args.experts // 2
    cfg = MoEConfig(num_experts=E, top_k=K, hidden_size=H, intermediate_size=I, dtype=torch.bfloat16,
                    renormalize=False)
    gen = torch.Generator(device=device).manual_seed(0)
    weights = MoEWeights(gate=None, gate_up=_randn((E, 2 * I, H), 1 / H**0.5, gen, device),
                         down=_randn((E, H, I), 1 / I**0.5, gen, device))
    empty = MoEExperts(cfg, weights=weights, identity_experts=Z, device=device)
    plain = MoEExperts(cfg, weights=weights, device=device)
    flush = L2Flush(device)
    rows = []
    for tokens in [int(t) for t in args.tokens.split(",")]:
        x = torch.randn(tokens, H, generator=gen, device=device).to(torch.bfloat16)
        ids, w = picks(tokens, E, Z, gen, device)
        zero = ids >= E
        through = (w * zero).sum(-1, keepdim=True)
        ids0, w0 = ids.masked_fill(zero, 0), w.masked_fill(zero, 0)

        def run_empty(x=x, ids=ids, w=w):
            return empty(x, ids, w)

        def run_zeroed(x=x, ids=ids, w=w):
            with zeroing_layer():
                return empty(x, ids, w)

        def run_expert0(x=x, ids0=ids0, w0=w0, through=through):
            out = plain(x, ids0, w0)
            return (out.float() + x.float() * through).to(out.dtype)

        with torch.no_grad():
            a, b = run_empty().float(), run_expert0().float()
            scale = float(b.abs().max())
            if not torch.allclose(a, b, rtol=0, atol=2**-7 * scale):
                print(f"tokens {tokens}: the variants differ by {(a - b).abs().max():.3g} (scale {scale:.3g})",
                      file=sys.stderr)
                return 1
            if not torch.equal(run_zeroed(), run_empty()):
                print(f"tokens {tokens}: zeroing the empty picks' rows in the layer changed the output",
                      file=sys.stderr)
                return 1
            per_round, median = alternating_medians(
                {"empty": run_empty, "zeroed": run_zeroed, "expert0": run_expert0},
                rounds=args.rounds, reps=args.reps, flush=flush)
        row = {"tokens": tokens, "zero_fraction": float(zero.float().mean()), "empty_ms": median["empty"],
               "zeroed_ms": median["zeroed"], "expert0_ms": median["expert0"],
               "expert0_over_empty": median["expert0"] / median["empty"],
               "zeroed_over_empty": median["zeroed"] / median["empty"], "rounds": per_round}
        rows.append(row)
        print(f"tokens {tokens:6d}  zero picks {row['zero_fraction']:.3f}  empty {row['empty_ms']:.3f} ms  "
              f"zeroed {row['zeroed_ms']:.3f} ms  expert0 {row['expert0_ms']:.3f} ms  "
              f"expert0/empty {row['expert0_over_empty']:.3f}  zeroed/empty {row['zeroed_over_empty']:.3f}",
              flush=True)
    if args.json:
        out = {"command": "python3 scripts/empty_picks_study.py " + " ".join(sys.argv[1:] if argv is None else argv),
               "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
               "date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               "shape": {"experts": E, "zero_experts": Z, "top_k": K, "hidden": H, "intermediate": I}, "rows": rows}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
