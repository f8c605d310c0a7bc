"""An optimizer's state, saved beside a trained checkpoint and read back to go on training.

Each rank holds the optimizer state of its own parameters: an expert shard's moments are that
shard's, a replicated parameter's are the same on every rank that holds it. Two forms:

- **Whole** (``moeshard train --save``: ``whole_state`` and ``write_whole``, inside the model's
  atomic write). Every moment is put back into the whole tensor of transformers' parameter it
  belongs to, as the model's own parameters are (``checkpoint.writer.placed_tensors``), and read
  back by any layout (``load_whole_state``: ``training.rank_parts``):

      DIR/optimizer/meta.json            ``OptimizerMeta`` (format 2): the saving layout, optimizer,
                                         steps done, the 0-d entries (AdamW's step) by parameter
                                         or block, the parameters without state
      DIR/optimizer/state.safetensors    "<transformers parameter name>/<state key>", fp32, whole

  A loop of one's own writes it with ``save_sharded_model(..., optimizer=)`` and reads it with
  ``load_sharded_optimizer``.

- **Per rank** (``save_rank_state`` on every rank; format 1), read back by the same rank of the
  same layout (``load_rank_state``):

      DIR/optimizer/meta.json            ``OptimizerMeta`` (format 1)
      DIR/optimizer/rank-00000.safetensors   rank 0's state: "<parameter name>/<state key>"

A per-rank state tensor keeps its dtype (AdamW's ``step`` is a 0-d fp32 tensor, its moments the
parameter's dtype); whole moments are fp32, which holds every bf16 and fp16 value exactly, and
``Optimizer.load_state_dict`` casts them to the parameter's dtype. A state whose names, shapes or
layout do not fit the run reading it is refused before any step, naming the rank and the tensor.
The hyperparameters (learning rate, betas, ...) are not read back: the run's own flags give them,
as they gave them to the run that saved.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from moeshard.checkpoint.families import ModelFamily
from moeshard.checkpoint.writer import RankState
from moeshard.config import MoEConfig
from moeshard.sharding import ShardSpec
from moeshard.training.rank_parts import RankParts, block_of

SUBDIR = "optimizer"
META = "meta.json"
WHOLE = "state.safetensors"
FORMAT = 1  # per rank
FORMAT_WHOLE = 2  # whole tensors, any layout
FORMATS = (FORMAT, FORMAT_WHOLE)


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.safetensors"


@dataclass(frozen=True)
class OptimizerMeta:
    """What a saved optimizer state belongs to. layout: ``ParallelConfig.name`` (dp2-tp1-ep) of the
    run that saved it; world_size: its ranks; backend: the dispatch backend; optimizer:
    ``moeshard train``'s name (adamw, sgd); steps_done: optimizer steps taken since the model was
    first trained from a checkpoint without state (a resumed run adds its own); dtype: the model
    dtype's name; scalars: (whole form) each 0-d state entry (AdamW's ``step``) by where it holds:
    a transformers parameter outside the MoE blocks, or a block's module name (one value for all
    its parameters, on every rank); stateless: (whole form) transformers' parameters without state, which no
    step gave a gradient; format: ``FORMAT`` (per rank) or ``FORMAT_WHOLE``."""

    layout: str
    world_size: int
    backend: str
    optimizer: str
    steps_done: int
    dtype: str
    format: int = FORMAT
    scalars: dict[str, dict[str, float]] | None = None
    stateless: list[str] | None = None

    @property
    def whole(self) -> bool:
        return self.format == FORMAT_WHOLE

    def refusal(self, layout: str, world_size: int, backend: str, optimizer: str, dtype: str) -> str:
        """Why a run of these settings cannot go on from this state ("" when it can): another
        optimizer, or for a per-rank state another layout, world size, backend or dtype."""
        if self.format not in FORMATS:
            return f"format {self.format} (this moeshard reads {list(FORMATS)})"
        wanted: dict[str, object] = {"optimizer": optimizer}
        saved: dict[str, object] = {"optimizer": self.optimizer}
        if not self.whole:
            wanted = {"layout": layout, "world size": world_size, "backend": backend, **wanted, "dtype": dtype}
            saved = {"layout": self.layout, "world size": self.world_size, "backend": self.backend, **saved,
                     "dtype": self.dtype}
        return "; ".join(f"{k} {saved[k]!r} (this run: {wanted[k]!r})" for k in wanted if saved[k] != wanted[k])


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


def whole_state(model_dir: str | Path, cfg: MoEConfig, model: nn.Module, ranks: list[RankState],
                states: dict[int, dict[str, torch.Tensor]]) -> tuple[dict[str, torch.Tensor],
                                                                     dict[str, dict[str, float]], list[str]]:
    """Every rank's state (``states[rank]``, ``rank_state``'s form; ``ranks``: each rank's
    ``RankState``, whose shards place the moments) as whole tensors under transformers' parameter
    names (``model``: transformers' model of ``model_dir``), and the 0-d entries.

    Returns ("<transformers parameter>/<state key>" -> fp32 CPU tensor of that parameter's shape,
    {state key: {a parameter outside the blocks, or a block's module name: its value}}, the
    transformers parameters without state: those no step gave a gradient, which an optimizer such
    as AdamW leaves without state until one does). A parameter that had gradients at fewer steps
    keeps its own count. ValueError, naming them, where a 0-d entry differs between the
    parameters of one block or the copies of one parameter (it is saved once for them);
    RuntimeError where the ranks hold state for part of a block parameter only."""
    from moeshard.checkpoint.writer import placed_tensors

    scalars: dict[str, dict[str, tuple[float, str]]] = {}
    fields: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    if not any(states[r.rank] for r in ranks):
        return {}, {}, []  # an optimizer without state (SGD without momentum)
    for r in ranks:
        for key, value in states[r.rank].items():
            name, _, field_name = key.rpartition("/")
            if value.dim() == 0:
                where = block_of(name, r.shards) or name
                seen = scalars.setdefault(field_name, {}).setdefault(where, (float(value), f"rank {r.rank}'s {key}"))
                if float(value) != seen[0]:
                    raise ValueError(f"optimizer state: rank {r.rank}'s {key} is {float(value)}, {seen[1]} {seen[0]}; "
                                     f"a whole state keeps one {field_name!r} for {where}")
            else:
                fields.setdefault(field_name, {}).setdefault(r.rank, {})[name] = value
    params = dict(model.named_parameters())
    tensors: dict[str, torch.Tensor] = {}
    for field_name, by_rank in fields.items():
        parts = [RankState(r.rank, by_rank.get(r.rank, {}), r.shards) for r in ranks]
        # Rows transformers never uses (zero-computation experts' gate_up) hold no moment: zeros.
        for name, value in placed_tensors(model_dir, cfg, parts, model, absent_ok=True, unused=0.0).items():
            if name in params:  # not the buffers it keeps as read
                tensors[f"{name}/{field_name}"] = value.float().contiguous()
    stateless = sorted(name for name in params if not any(f"{name}/{f}" in tensors for f in fields))
    return tensors, {f: {w: v for w, (v, _) in by.items()} for f, by in scalars.items()}, stateless


def write_whole(directory: str | Path, meta: OptimizerMeta, tensors: dict[str, torch.Tensor]) -> None:
    """Writes a whole state (``whole_state``'s tensors; ``meta`` in ``FORMAT_WHOLE`` with its
    scalars) under ``directory`` (an existing checkpoint directory; its ``optimizer`` folder must
    not exist: nothing is overwritten)."""
    if not meta.whole or meta.scalars is None:
        raise ValueError(f"optimizer state: a whole state's meta has format {FORMAT_WHOLE} and its scalars, got "
                         f"format {meta.format}, scalars {meta.scalars}")
    (Path(directory) / SUBDIR).mkdir()
    save_file(tensors, str(Path(directory) / SUBDIR / WHOLE), metadata={"layout": meta.layout})
    _write_meta(directory, meta)


def load_whole_state(optimizer: torch.optim.Optimizer, model: nn.Module, directory: str | Path, rank: int,
                     shards: dict[str, ShardSpec], family: ModelFamily, cfg: MoEConfig) -> None:
    """Puts this rank's part of the whole state under ``directory`` into ``optimizer`` (built over
    ``model``'s trained parameters, before any step), whatever layout saved it; shards: the rank's
    MoE blocks' module names -> their ``ShardSpec``. ValueError naming the rank and the tensor
    for a state that does not fit: a trained parameter it has no moments of, a tensor of no
    parameter, a shape apart from the parameter's part."""
    path = Path(directory) / SUBDIR / WHOLE
    where = f"rank {rank}: optimizer state {path}"
    meta = read_meta(directory)
    if meta is None or not meta.whole or meta.scalars is None or not path.is_file():
        raise ValueError(f"{where} is missing, or its meta.json is not a whole state's")
    saved = load_file(str(path))
    by_field: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in saved.items():
        name, _, field_name = key.rpartition("/")
        by_field.setdefault(field_name, {})[name] = value
    params = {name: p for name, p in model.named_parameters() if p.requires_grad}
    names = {id(p): name for name, p in params.items()}
    parts = {field_name: RankParts(family, cfg, whole) for field_name, whole in by_field.items()}
    stateless = set(meta.stateless or ())
    state: dict[int, dict[str, torch.Tensor]] = {}
    for index, p in enumerate(q for group in optimizer.param_groups for q in group["params"]):
        name = names[id(p)]
        held: dict[str, torch.Tensor] = {}
        for field_name, rank_parts in parts.items():
            try:
                part = rank_parts.of(name, shards)
            except KeyError:
                if name in stateless:
                    continue  # the saving run never stepped it: no state, as then
                raise ValueError(f"{where}: no {field_name!r} for the trained parameter {name!r}") from None
            except (IndexError, RuntimeError, ValueError) as exc:  # a block's tensors of other shapes
                raise ValueError(f"{where}: {name}/{field_name}: this rank's part cannot be cut from the saved "
                                 f"tensors ({exc}; saved for another model?)") from None
            if tuple(part.shape) != tuple(p.shape):
                raise ValueError(f"{where}: {name}/{field_name} is {list(part.shape)} of this rank, the parameter "
                                 f"{list(p.shape)} (saved for another model?)")
            held[field_name] = part.clone()
        if held:  # load_state_dict puts each on its parameter's device and dtype
            holder = block_of(name, shards) or name
            lacking = [f for f, by in meta.scalars.items() if holder not in by]
            if lacking:
                raise ValueError(f"{where}: no {lacking} for the trained parameter {name!r} (kept for {holder!r})")
            state[index] = {**{f: torch.tensor(by[holder]) for f, by in meta.scalars.items()}, **held}
    current = optimizer.state_dict()
    optimizer.load_state_dict({"state": state, "param_groups": current["param_groups"]})


def whole_writer(model_dir: str | Path, cfg: MoEConfig, ranks: list[RankState],
                 states: dict[int, dict[str, torch.Tensor]], meta: OptimizerMeta) -> Callable[[str, nn.Module], None]:
    """What ``save_checkpoint(..., also=)`` calls to write the whole state beside the model:
    ``whole_state`` of the ranks' ``states`` into transformers' ``model`` it was given, under
    ``meta`` (its scalars filled in)."""

    def write(directory: str, model: nn.Module) -> None:
        tensors, scalars, stateless = whole_state(model_dir, cfg, model, ranks, states)
        write_whole(directory, replace(meta, format=FORMAT_WHOLE, scalars=scalars, stateless=stateless), tensors)

    return write


def load_sharded_optimizer(optimizer: torch.optim.Optimizer, model: nn.Module, directory: str | Path) -> OptimizerMeta:
    """For a training loop of one's own: puts this rank's part of the whole state that
    ``save_sharded_model(..., optimizer=)`` (or ``moeshard train --save``) wrote under
    ``directory`` into ``optimizer`` (built over ``model``'s trained parameters, before any step;
    ``model``: a model of ``load_sharded_model(directory, groups)`` under any layout). Returns the
    state's ``OptimizerMeta`` (``steps_done``: where to start the schedule). Rank-local, no
    collective; ValueError naming the rank and the tensor for a state that does not fit."""
    from moeshard.checkpoint.hf_config import read_hf_config
    from moeshard.layer import MoELayer

    blocks = {name: m for name, m in model.named_modules() if isinstance(m, MoELayer)}
    if not blocks:
        raise ValueError(f"load_sharded_optimizer: {type(model).__name__} has no moeshard MoE block (load it with "
                         f"load_sharded_model)")
    layer = next(iter(blocks.values()))
    meta = read_meta(directory)
    if meta is None or not meta.whole:
        raise ValueError(f"load_sharded_optimizer: {directory} holds no whole optimizer state ({SUBDIR}/{WHOLE} and "
                         f"its meta.json, as save_sharded_model(..., optimizer=) writes)")
    rank = layer.groups.rank if layer.groups is not None else 0
    load_whole_state(optimizer, model, directory, rank, {n: m.shard for n, m in blocks.items()},
                     read_hf_config(directory).family, layer.cfg)
    return meta
