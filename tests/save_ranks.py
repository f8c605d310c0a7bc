"""The ranks of ``tests/test_train_save.py``'s library case: load a tiny model sharded, move every
parameter and selection bias, save it with ``save_sharded_model``, report what this rank holds."""

from __future__ import annotations

import torch

from moeshard.dispatch.registry import build_groups
from moeshard.integrations.transformers import load_sharded_model, save_sharded_model
from moeshard.layer import MoELayer
from moeshard.parallel.config import ParallelConfig


def load_move_save(model_dir: str, directory: str, dp: int, tp: int, ep: bool) -> dict:
    """Every parameter + 0.25 and every selection bias + 0.01 x its expert's index (the same on
    every copy, so the saved model must hold exactly these values), then saved."""
    groups = build_groups(ParallelConfig(dp, tp, ep), "cpu")
    model = load_sharded_model(model_dir, groups, dtype="float32")
    biases = {}
    with torch.no_grad():
        for q in model.parameters():
            q.add_(0.25)
        for name, layer in model.named_modules():
            bias = getattr(getattr(layer, "gate", None), "e_score_correction_bias", None)
            if isinstance(layer, MoELayer) and bias is not None:
                bias.add_(0.01 * torch.arange(bias.numel(), dtype=bias.dtype))
                biases[f"{name}.gate.e_score_correction_bias"] = bias.detach().clone()
    written = save_sharded_model(model, groups, model_dir, directory)
    return {"rank": groups.rank, "written": written, "biases": biases,
            "params": {n: q.detach().clone() for n, q in model.named_parameters()},
            "shards": {n: m.shard for n, m in model.named_modules() if isinstance(m, MoELayer)}}
