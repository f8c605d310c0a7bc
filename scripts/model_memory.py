"""Peak memory of loading a whole transformers MoE model under a layout: each rank's share.

Saves a random Qwen3-MoE model (``--layers`` x 16 experts, H = I = 512, fp32; about 50 MiB of
experts per layer) with ``save_pretrained`` to a temporary directory, then for each layout starts
its ranks (``moeshard.parallel.spawn``, gloo on CPU) and has every rank run
``load_sharded_model``; each rank reports how much its resident set grew at peak, and the bytes
of expert and non-expert tensors it keeps. The last row loads the whole model with transformers'
``from_pretrained`` in one process, for contrast.

Peak = ``VmHWM``, reset with ``/proc/self/clear_refs`` after the imports (transformers and the
model's classes, about 170 MiB of code by themselves) (Linux), as ``scripts/checkpoint_memory.py`` does.

    PYTHONPATH=src .venv/bin/python scripts/model_memory.py [--layers 8] [--keep DIR]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

from checkpoint_memory import reset_peak, status_kib  # scripts/: the same /proc readings

from moeshard.parallel.config import ParallelConfig

LAYOUTS = [ParallelConfig(1, 1, False), ParallelConfig(2, 1, True), ParallelConfig(4, 1, True),
           ParallelConfig(1, 2, False), ParallelConfig(2, 2, True)]


def _held(model) -> tuple[int, int]:
    """(bytes of routed-expert tensors, bytes of every other parameter and buffer) this process holds."""
    from moeshard.integrations.transformers import expert_bytes

    experts = expert_bytes(model)
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.nbytes
    return experts, total - experts


def probe_rank(path: str, layout: ParallelConfig | None) -> dict:
    """On a rank: load (moeshard's share, or with layout None the whole model by transformers)."""
    import torch
    import transformers  # noqa: F401 - imported before the baseline is taken

    from moeshard.integrations.transformers import load_sharded_model
    from moeshard.parallel.groups import ParallelGroups

    # The model's classes are imported before the baseline: their code (~170 MiB of imports)
    # is not the weights this measures.
    transformers.AutoModelForCausalLM, transformers.Qwen3MoeForCausalLM, transformers.GenerationConfig  # noqa: B018
    torch.set_num_threads(1)
    groups = ParallelGroups.build(layout) if layout is not None and layout.world_size > 1 else None
    reset_peak()
    before = status_kib("VmRSS")
    if layout is None:
        model = transformers.AutoModelForCausalLM.from_pretrained(path)
    else:
        model = load_sharded_model(path, groups)
    experts, other = _held(model)
    return {"growth": (status_kib("VmHWM") - before) * 1024, "experts": experts, "other": other}


def write_model(path: Path, layers: int) -> None:
    import torch
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.Qwen3MoeConfig(vocab_size=1024, hidden_size=512, intermediate_size=1024, moe_intermediate_size=512,
                            num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4, num_experts=16,
                            num_experts_per_tok=2, norm_topk_prob=True)
    tf.AutoModelForCausalLM.from_config(cfg).save_pretrained(path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--keep", metavar="DIR", help="write the model here and keep it (reused when it exists)")
    args = parser.parse_args()

    from rich.console import Console
    from rich.table import Table

    from moeshard.parallel.spawn import spawn

    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="moeshard-model-"))
    try:
        if not (root / "model" / "config.json").is_file():
            write_model(root / "model", args.layers)
        size = sum(p.stat().st_size for p in (root / "model").glob("*.safetensors"))
        title = f"loading a {size / 2**20:.0f} MiB Qwen3-MoE model ({args.layers} layers x 16 experts, fp32)"
        table = Table(title=title)
        for col in ("layout", "rank", "experts MiB", "other MiB", "peak growth MiB", "growth / file"):
            table.add_column(col, justify="right")
        for layout in LAYOUTS + [None]:
            ranks = spawn(probe_rank, layout.world_size if layout else 1, args=(str(root / "model"), layout),
                          timeout_s=600)
            for rank, m in enumerate(ranks):
                table.add_row(layout.name if layout else "from_pretrained", str(rank), f"{m['experts'] / 2**20:.1f}",
                              f"{m['other'] / 2**20:.1f}", f"{m['growth'] / 2**20:.1f}", f"{m['growth'] / size:.2f}")
        Console().print(table)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
