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


def step_and_save(model_dir: str, directory: str, dp: int, tp: int, ep: bool) -> dict:
    """One AdamW step of a loop of one's own (this rank's gradients reduced as ``moeshard train``
    reduces them), saved with its optimizer state by ``save_sharded_model(..., optimizer=)``; then
    a fresh AdamW reads this rank's part back (``load_sharded_optimizer``). Reports whether every
    state tensor came back bit for bit."""
    from moeshard.training import reduce_gradients
    from moeshard.training.optimizer_state import load_sharded_optimizer

    groups = build_groups(ParallelConfig(dp, tp, ep), "cpu")
    model = load_sharded_model(model_dir, groups, dtype="float32")
    model.requires_grad_(True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    ids = torch.tensor([[3, 17, 42, 5, 9, 1, 2, 3]])
    model(ids).logits.float().pow(2).mean().backward()
    reduce_gradients(model, groups)
    optimizer.step()
    save_sharded_model(model, groups, model_dir, directory, optimizer=optimizer, steps_done=1)
    fresh = torch.optim.AdamW(model.parameters(), lr=0.01)
    meta = load_sharded_optimizer(fresh, model, directory)
    mine, back = optimizer.state_dict()["state"], fresh.state_dict()["state"]
    same = mine.keys() == back.keys() and all(
        mine[i].keys() == back[i].keys() and all(torch.equal(mine[i][k], back[i][k]) for k in mine[i]) for i in mine)
    return {"rank": groups.rank, "same": same, "steps_done": meta.steps_done, "layout": meta.layout,
            "fields": sorted({k for s in mine.values() for k in s})}
