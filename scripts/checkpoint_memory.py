"""Peak memory of loading one rank's share of an MoE block from a checkpoint.

Writes a random Qwen3-MoE-style checkpoint with fused experts (``--size-mb``, default ~400 MB,
fp32) to a temporary directory, then, for each layout, loads rank 0's share in a fresh process
and reports how much its resident set grew at peak, next to what the rank keeps and to the file
size. The last row loads the whole file with ``safetensors.torch.load_file`` for contrast.

Peak = ``VmHWM`` of the child, reset with ``/proc/self/clear_refs`` after its imports (Linux).
``getrusage().ru_maxrss`` is not used: Linux carries it across fork+exec, so a child of a large
parent reports the parent's size.

    PYTHONPATH=src .venv/bin/python scripts/checkpoint_memory.py [--size-mb 400] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# Layouts measured (dp, tp, ep, quant): rank 0 of each.
LAYOUTS = [(1, 1, False, "none"), (2, 1, True, "none"), (4, 1, True, "none"), (8, 1, True, "none"),
           (1, 4, False, "none"), (1, 4, False, "fp8_block"), (1, 4, False, "fp8_tensor")]


def status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def reset_peak() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := current RSS
    except OSError:
        pass


def probe(path: str, dp: int, tp: int, ep: bool, quant: str) -> dict:
    """In the child: load rank 0's share (or, dp == 0, the whole file) and measure."""
    # torch (and everything the loader imports) is loaded before the baseline is taken.
    from moeshard.checkpoint import load_moe_block
    from moeshard.parallel.config import ParallelConfig
    from moeshard.quant import QuantizedWeight

    reset_peak()
    before = status_kib("VmRSS")
    if dp == 0:
        from safetensors.torch import load_file

        tensors = load_file(str(Path(path) / "model.safetensors"))
        # load_file may hand out views of the file mapping: touch every value, as using the
        # weights would, so the baseline counts what a whole-file load really makes resident.
        held = 0
        for t in tensors.values():
            t.sum()  # reads every value; the sum itself is not needed
            held += t.nbytes
    else:
        block = load_moe_block(path, 0, parallel=ParallelConfig(dp, tp, ep), rank=0, quant=quant)
        held = 0
        for w in (block.local_experts.gate_up, block.local_experts.down):
            parts = [w.data, w.scale, w.global_scale] if isinstance(w, QuantizedWeight) else [w]
            held += sum(p.nbytes for p in parts if p is not None)
    return {"growth": (status_kib("VmHWM") - before) * 1024, "held": held}


def write_checkpoint(path: Path, size_mb: int) -> int:
    """Random fused qwen3_moe layer 0 of about ``size_mb`` MB (E = 16, H = 1024, I sized to fit)."""
    import torch
    from safetensors.torch import save_file

    E, H = 16, 1024
    I = max(128, (size_mb * 2**20 // (E * 3 * H * 4)) // 128 * 128)
    gen = torch.Generator().manual_seed(0)
    p = "model.layers.0.mlp."
    path.mkdir(parents=True, exist_ok=True)
    save_file({p + "gate.weight": torch.randn(E, H, generator=gen),
               p + "experts.gate_up_proj": torch.randn(E, 2 * I, H, generator=gen) / H**0.5,
               p + "experts.down_proj": torch.randn(E, H, I, generator=gen) / I**0.5}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({
        "model_type": "qwen3_moe", "num_hidden_layers": 1, "hidden_size": H, "moe_intermediate_size": I,
        "num_experts": E, "num_experts_per_tok": 2, "norm_topk_prob": True, "dtype": "float32"}))
    return (path / "model.safetensors").stat().st_size


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=400)
    parser.add_argument("--keep", metavar="DIR", help="write the checkpoint here and keep it")
    parser.add_argument("--probe", nargs=5, metavar=("DIR", "DP", "TP", "EP", "QUANT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.probe:
        path, dp, tp, ep, quant = args.probe
        print(json.dumps(probe(path, int(dp), int(tp), ep == "1", quant)))
        return 0

    from rich.console import Console
    from rich.table import Table

    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="moeshard-ckpt-"))
    try:
        size = write_checkpoint(root / "ckpt", args.size_mb)
        table = Table(title=f"rank 0 loading from a {size / 2**20:.0f} MiB checkpoint (16 experts, fp32)")
        for col in ("layout", "quant", "kept MiB", "peak growth MiB", "growth / file", "growth - kept MiB"):
            table.add_column(col, justify="right")
        for dp, tp, ep, quant in LAYOUTS + [(0, 0, False, "whole file")]:
            done = subprocess.run([sys.executable, __file__, "--probe", str(root / "ckpt"), str(dp), str(tp),
                                   "1" if ep else "0", quant], capture_output=True, text=True, timeout=600)
            if done.returncode:
                print(done.stderr, file=sys.stderr)
                return 1
            m = json.loads(done.stdout.strip().splitlines()[-1])
            name = "load_file" if dp == 0 else f"dp{dp}-tp{tp}" + ("-ep" if ep else "")
            table.add_row(name, quant, f"{m['held'] / 2**20:.1f}", f"{m['growth'] / 2**20:.1f}",
                          f"{m['growth'] / size:.2f}", f"{(m['growth'] - m['held']) / 2**20:.1f}")
        Console().print(table)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
