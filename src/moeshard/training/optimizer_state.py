"""An optimizer's state, saved beside a trained checkpoint and read back to go on training.

Each rank holds the optimizer state of its own parameters: an expert shard's moments are that
shard's, a replicated parameter's are the same on every rank that holds it. So the state is saved
per rank, under the checkpoint directory (by ``moeshard train --save``: ``write``, inside the
model's atomic write; in a loop of one's own: ``save_rank_state`` on every rank), and read back
by the same rank of the same layout (``load_rank_state``):

    DIR/optimizer/meta.json                    ``OptimizerMeta``: layout, optimizer, steps done
    DIR/optimizer/rank-00000.safetensors       rank 0's state: "<parameter name>/<state key>"

A state tensor keeps its dtype (AdamW's ``step`` is a 0-d fp32 tensor, its moments the
parameter's dtype). The parameter names are those of the sharded model (``load_sharded_model``),
the same on every run of one layout; a state whose names, shapes or layout differ from the run
reading it is refused before any step, naming the rank and the tensor. The hyperparameters
(learning rate, betas, ...) are not read back: the run's own flags give them, as they gave them
to the run that saved.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

SUBDIR = "optimizer"
META = "meta.json"
FORMAT = 1


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.safetensors"


@dataclass(frozen=True)
class OptimizerMeta:
    """What a saved optimizer state belongs to. layout: ``ParallelConfig.name`` (dp2-tp1-ep);
    world_size: its ranks; backend: the dispatch backend; optimizer: ``moeshard train``'s name
    (adamw, sgd); steps_done: optimizer steps taken since the model was first trained from a
    checkpoint without state (a resumed run adds its own); dtype: the model dtype's name."""

    layout: str
    world_size: int
    backend: str
    optimizer: str
    steps_done: int
    dtype: str
    format: int = FORMAT

    def refusal(self, layout: str, world_size: int, backend: str, optimizer: str, dtype: str) -> str:
        """Why a run of these settings cannot go on from this state ("" when it can)."""
        wanted = {"layout": layout, "world size": world_size, "backend": backend, "optimizer": optimizer,
                  "dtype": dtype}
        saved = {"layout": self.layout, "world size": self.world_size, "backend": self.backend,
                 "optimizer": self.optimizer, "dtype": self.dtype}
        differ = [f"{k} {saved[k]!r} (this run: {wanted[k]!r})" for k in wanted if saved[k] != wanted[k]]
        if self.format != FORMAT:
            differ.insert(0, f"format {self.format} (this moeshard reads {FORMAT})")
        return "; ".join(differ)


def read_meta(directory: str | Path) -> OptimizerMeta | None:
    """The ``OptimizerMeta`` saved under ``directory`` (a checkpoint directory), None where it
    holds no optimizer state; ValueError for a meta.json that is not one."""
    path = Path(directory) / SUBDIR / META
    if not path.is_file():
        return None
    try:
        raw = json.loads(path.read_text())
        return OptimizerMeta(**raw)
    except (json.JSONDecodeError, TypeError) as exc:
        raise ValueError(f"{path}: not an optimizer state's meta.json ({exc})") from None


def rank_state(optimizer: torch.optim.Optimizer, model: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's optimizer state, by "<parameter name>/<state key>", on the CPU (a non-tensor
    value, as SGD without momentum keeps ``momentum_buffer`` None, is left out)."""
    names = {id(p): name for name, p in model.named_parameters()}
    out: dict[str, torch.Tensor] = {}
    for param, state in optimizer.state.items():
        name = names[id(param)]
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                out[f"{name}/{key}"] = value.detach().cpu().contiguous()
    return out


def write(directory: str | Path, meta: OptimizerMeta, states: dict[int, dict[str, torch.Tensor]]) -> None:
    """Writes every rank's state (``states[rank]``) and ``meta`` under ``directory`` (an existing
    checkpoint directory; its ``optimizer`` folder must not exist: nothing is overwritten)."""
    if sorted(states) != list(range(meta.world_size)):
        raise ValueError(f"optimizer state: ranks {sorted(states)} given, expected 0..{meta.world_size - 1}")
    (Path(directory) / SUBDIR).mkdir()
    for rank, state in states.items():
        _write_rank(directory, meta, rank, state)
    _write_meta(directory, meta)


def save_rank_state(directory: str | Path, meta: OptimizerMeta, rank: int, optimizer: torch.optim.Optimizer,
                    model: nn.Module) -> None:
    """For a training loop of one's own: this rank writes its own state under ``directory`` (a
    checkpoint ``save_sharded_model`` wrote), rank 0 the meta too; every rank of ``meta``'s layout
    calls it, after that save, and ``load_rank_state`` reads it back. Refuses to write over a
    rank's file or a meta that exists (FileExistsError)."""
    if not 0 <= rank < meta.world_size:
        raise ValueError(f"optimizer state: rank {rank} outside the {meta.world_size} rank(s) of {meta.layout}")
    (Path(directory) / SUBDIR).mkdir(exist_ok=True)
    _write_rank(directory, meta, rank, rank_state(optimizer, model))
    if rank == 0:
        _write_meta(directory, meta)


def _write_rank(directory: str | Path, meta: OptimizerMeta, rank: int, state: dict[str, torch.Tensor]) -> None:
    path = Path(directory) / SUBDIR / rank_file(rank)
    if path.exists():
        raise FileExistsError(f"rank {rank}: optimizer state {path} exists; it is never written over")
    save_file(state, str(path), metadata={"rank": str(rank), "layout": meta.layout})


def _write_meta(directory: str | Path, meta: OptimizerMeta) -> None:
    path = Path(directory) / SUBDIR / META
    with open(path, "x") as f:  # "x": never over an existing meta
        f.write(json.dumps(asdict(meta), indent=1) + "\n")


def load_rank_state(optimizer: torch.optim.Optimizer, model: nn.Module, directory: str | Path, rank: int) -> None:
    """Puts the state saved for ``rank`` under ``directory`` into ``optimizer`` (built over
    ``model``'s trained parameters, before any step). ValueError naming the rank and the tensor
    for a state that does not fit: a parameter without state or a state without parameter, a
    parameter lacking a field the others have, a shape apart from the parameter's."""
    path = Path(directory) / SUBDIR / rank_file(rank)
    where = f"rank {rank}: optimizer state {path}"
    if not path.is_file():
        raise ValueError(f"{where} is missing")
    saved = load_file(str(path))
    params = {name: p for name, p in model.named_parameters() if p.requires_grad}
    by_param: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in saved.items():
        name, _, field = key.rpartition("/")
        if name not in params:
            raise ValueError(f"{where}: holds state for {name!r}, which this rank's model has no trained parameter of")
        by_param.setdefault(name, {})[field] = value
    missing = [name for name in params if name not in by_param]
    if by_param and missing:
        raise ValueError(f"{where}: no state for {len(missing)} trained parameter(s), e.g. {missing[:3]}")
    # Every parameter's state has the same fields (AdamW: step, exp_avg, exp_avg_sq).
    every: set[str] = set().union(*(set(f) for f in by_param.values())) if by_param else set()
    short = {name: sorted(every - set(f)) for name, f in by_param.items() if set(f) != every}
    if short:
        name, lacking = next(iter(short.items()))
        raise ValueError(f"{where}: the state of {len(short)} parameter(s) lacks fields the others have, e.g. "
                         f"{name!r} lacks {lacking}")
    order = [p for group in optimizer.param_groups for p in group["params"]]
    names = {id(p): name for name, p in params.items()}
    state: dict[int, dict[str, torch.Tensor]] = {}
    for index, p in enumerate(order):
        name = names[id(p)]
        held = by_param.get(name, {})
        for field, value in held.items():
            if value.dim() and (tuple(value.shape) != tuple(p.shape)):
                raise ValueError(f"{where}: {name}/{field} is {list(value.shape)}, the parameter "
                                 f"{list(p.shape)} (saved by another layout or model?)")
        if held:
            state[index] = dict(held)  # load_state_dict puts each on its parameter's device and dtype
    current = optimizer.state_dict()
    optimizer.load_state_dict({"state": state, "param_groups": current["param_groups"]})
