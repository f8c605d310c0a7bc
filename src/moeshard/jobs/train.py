"""What ``moeshard train`` does: plan once (no processes yet), then a few optimizer steps of a whole
transformers model on every rank, then (on request) the same steps by transformers alone.

    plan_train(TrainSpec)          parent, before any process starts: reads config.json, checks the
                                   prompts, the layout against the model, that the combination has
                                   a backward (quant ``none``, a backend with one), the optimizer;
                                   refuses with a ValueError
    train_rank(plan, groups)       every rank: ``load_sharded_model``, then ``spec.steps`` steps on
                                   its DP rank's prompts -> TrainRankResult
    train_plans(plans)             ``spawn`` entry: several plans on one set of ranks
    reference_train(plan)          transformers alone (``from_pretrained``, fp32 or float64, every
                                   expert, one device), the whole batch (the same micro-batches), the
                                   same optimizer, schedule, clipping and steps
    compare_training(...)          losses, gradient norm and every trained parameter, moeshard
                                   against transformers; given transformers' float64 run too, the
                                   losses judged against the float32 rounding the model amplifies

One step, on every rank (docs/training.md's replicated loss): DP rank d's loss is
``L_d = (sum of its tokens' next-token cross entropies) / N + coef * aux_d``, N the number of
predicted tokens of the global batch (every position but each prompt's first: the labels of
padding and of a prompt's first token are -100, as transformers' labels ignore them) and
``aux_d`` DP rank d's share of the load-balancing loss over the global batch
(``moeshard.training.router_losses``), added where transformers' own loss adds it (the config's
``output_router_logits``, its ``router_aux_loss_coef``); transformers' own per-rank auxiliary loss
stays off. The sum of the L_d is transformers' loss of the whole batch on one device. Then one
backward, ``reduce_gradients``, ``grad_norm`` (or ``clip_grad_norm_``), one optimizer step and
one step of the learning-rate schedule on every rank: each rank steps its own parameters (its
expert shards; its copies of everything else, identical on every rank after the reduction). The
loss reported before step s is the sum over DP ranks of L_d (from each DP rank's TP rank 0) in
the forward of step s, before its update.

With M micro-batches each DP rank splits its prompts into M contiguous parts and runs a forward
and a backward on each, the gradients accumulating, before the one reduction and step. A part's
cross entropies are still a share of the global N, so they sum to the whole batch's; its
load-balancing loss is over the global micro-batch (every DP rank's part m) and weighs 1/M, so
the step's is the mean of its micro-batches'. transformers alone runs the same global
micro-batches in the same order.

Prompts and batches are ``moeshard generate``'s: prompt i goes to DP rank d by a contiguous
split, a DP rank's prompts are one left-padded batch with an attention mask, and the positions
count from each prompt's first token (as generate numbers them), so a prompt's loss does not
depend on the padding in front of it. The model runs in eval mode: dropout and router jitter
are random, and these steps are meant to be compared.
"""

from __future__ import annotations

import math
import os
import time
import warnings
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
from torch import nn

from moeshard.autograd.support import backward_refusal
from moeshard.checkpoint.hf_config import read_hf_config
from moeshard.checkpoint.hf_model import load_transformers_model, transformers_refusal
from moeshard.checkpoint.loader import resolve_quant
from moeshard.config import MoEConfig, QuantConfig, dtype_name, parse_dtype
from moeshard.jobs.generate import PROMPT_SOURCES, check_prompts, padded_batch, split_prompts
from moeshard.jobs.world import RankPlace, each_plan, load_timed, synchronize
from moeshard.parallel.config import ParallelConfig
from moeshard.parallel.groups import ParallelGroups
from moeshard.sharding import ShardSpec
from moeshard.tolerances import TRAIN_LOSS_RTOL, train_bound
from moeshard.training import optimizer_state
from moeshard.training.rank_parts import RankParts
from moeshard.validate import is_int

IGNORE = -100  # transformers' ignore_index: a label that is no token to predict


@dataclass(frozen=True)
class Optimizer:
    """An optimizer of ``moeshard train``: ``torch.optim.<cls>(params, lr, **settings)``."""

    name: str
    cls: str
    settings: dict

    def build(self, params, lr: float) -> torch.optim.Optimizer:
        optimizer: torch.optim.Optimizer = getattr(torch.optim, self.cls)(params, lr=lr, **self.settings)
        return optimizer


# sgd: plain SGD, no momentum. adamw: the betas, epsilon and weight decay that transformers'
# TrainingArguments default to (adam_beta1, adam_beta2, adam_epsilon, weight_decay). The Trainer's
# linear learning-rate decay and its gradient clipping (max_grad_norm=1.0) are options
# (``TrainSpec.schedule``, ``max_grad_norm``), off by default.
OPTIMIZERS = {
    "sgd": Optimizer("sgd", "SGD", {"momentum": 0.0}),
    "adamw": Optimizer("adamw", "AdamW", {"betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}),
}
MAX_STEPS = 100_000
# Learning-rate schedules (``transformers.get_scheduler``'s names, the Trainer's ``lr_scheduler_type``):
# constant (the default here), or the rate warmed up linearly over ``warmup_steps`` and then held
# (constant_with_warmup), decayed linearly to 0 at the last step (linear, the Trainer's default),
# or along a half cosine to 0 (cosine).
SCHEDULES = ("constant", "constant_with_warmup", "linear", "cosine")


@dataclass(frozen=True)
class TrainSpec:
    """What the user asked for. prompts: token ids, one tuple per prompt (the training batch);
    steps: optimizer steps, each on the whole batch; lr: the learning rate; optimizer: a key of
    ``OPTIMIZERS``; schedule: the learning rate's schedule over the steps (``SCHEDULES``), with
    warmup_steps of linear warmup (the schedules that have one); max_grad_norm: None, or the
    global gradient norm each step's gradients are clipped to (``training.clip_grad_norm_``, as
    the Trainer's ``max_grad_norm``); micro_batches: the micro-batches each DP rank's prompts are
    split into (contiguously), their gradients accumulated before the step (1: the whole batch in
    one forward and backward); quant/dtype/backend None: the checkpoint's quantization (refused
    unless none) and dtype, the layout's default backend; compare: send every rank's trained
    parameters back, to compare with transformers alone; save_dir: a new directory to save the
    trained model to, as a Hugging Face checkpoint (``checkpoint.writer``), with the optimizer
    state beside it, whole (``training.optimizer_state``); resume: go on from the optimizer state
    saved with ``model_dir`` (by a run of the same optimizer, under any layout), its
    learning-rate schedule at the step it reached."""

    model_dir: str
    prompts: tuple[tuple[int, ...], ...]
    steps: int = 4
    lr: float = 5e-5
    optimizer: str = "adamw"
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    quant: str | None = None
    dtype: str | None = None
    backend: str | None = None
    device: str = "cpu"
    compare: bool = False
    prompts_from: str = "--input-ids"
    schedule: str = "constant"
    warmup_steps: int = 0
    max_grad_norm: float | None = None
    micro_batches: int = 1
    save_dir: str | None = None
    resume: bool = False

    @property
    def sends_parameters(self) -> bool:
        """Whether the ranks send their trained parameters back: to compare them, or to save them."""
        return self.compare or self.save_dir is not None

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"train: device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.prompts_from not in PROMPT_SOURCES:
            raise ValueError(f"train: prompts_from must be one of {list(PROMPT_SOURCES)}, got {self.prompts_from!r}")
        if not is_int(self.steps) or not 1 <= self.steps <= MAX_STEPS:
            raise ValueError(f"--steps: must be an integer in [1, {MAX_STEPS}], got {self.steps!r}")
        if (not isinstance(self.lr, (int, float)) or isinstance(self.lr, bool) or not math.isfinite(self.lr)
                or not self.lr > 0):
            raise ValueError(f"--lr: must be a finite number > 0, got {self.lr!r}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"--optimizer: {self.optimizer!r} is not one of {sorted(OPTIMIZERS)}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"--lr-schedule: {self.schedule!r} is not one of {list(SCHEDULES)}")
        # A resumed run's schedule spans the steps already taken too: plan_train checks its bound.
        if not is_int(self.warmup_steps) or not 0 <= self.warmup_steps <= (MAX_STEPS if self.resume else self.steps):
            raise ValueError(f"--warmup-steps: must be an integer in [0, --steps={self.steps}], got "
                             f"{self.warmup_steps!r}")
        if self.warmup_steps and self.schedule == "constant":
            raise ValueError(f"--warmup-steps {self.warmup_steps}: the constant schedule has no warmup; use "
                             f"--lr-schedule constant_with_warmup, linear or cosine")
        if self.max_grad_norm is not None and (
                not isinstance(self.max_grad_norm, (int, float)) or isinstance(self.max_grad_norm, bool)
                or not math.isfinite(self.max_grad_norm) or not self.max_grad_norm > 0):
            raise ValueError(f"--max-grad-norm: must be a finite number > 0, got {self.max_grad_norm!r}")
        if not is_int(self.micro_batches) or self.micro_batches < 1:
            raise ValueError(f"--micro-batches: must be an integer >= 1, got {self.micro_batches!r}")
        if not self.prompts or any(not p for p in self.prompts):
            raise ValueError(f"{self.prompts_from}: no prompt given, or an empty one")
        for i, prompt in enumerate(self.prompts):
            if any(not is_int(t) or t < 0 for t in prompt):
                raise ValueError(f"{self.prompts_from}: prompt {i} holds {list(prompt)[:8]}; token ids are integers "
                                 f">= 0")


@dataclass(frozen=True)
class TrainPlan:
    """A checked, resolved run; every rank executes the same plan. dp_prompts[d]: indices of the
    prompts DP rank d trains on; tokens: N, the predicted tokens of the global batch; aux_coef:
    the load-balancing loss's coefficient, None where transformers' loss has none; steps_before:
    the optimizer steps the resumed state has taken (0 without ``spec.resume``); resumed_layout:
    the layout that saved that state (None without ``spec.resume``)."""

    spec: TrainSpec
    model_type: str
    cfg: MoEConfig
    quant: QuantConfig
    backend: str
    pad_token_id: int
    dp_prompts: tuple[tuple[int, ...], ...]
    tokens: int
    aux_coef: float | None
    steps_before: int = 0
    resumed_layout: str | None = None

    def micro(self, dp_rank: int) -> tuple[tuple[int, ...], ...]:
        """The prompt indices of DP rank ``dp_rank``'s micro-batches, in order: its prompts split
        contiguously into ``spec.micro_batches`` (the first ones one longer where they do not
        divide evenly)."""
        mine = self.dp_prompts[dp_rank]
        return tuple(tuple(mine[i] for i in part) for part in split_prompts(len(mine), self.spec.micro_batches))

    def global_micro(self) -> tuple[tuple[int, ...], ...]:
        """Micro-batch m of the whole batch: every DP rank's m-th micro-batch, in DP rank order
        (what transformers alone trains on in the m-th forward of a step)."""
        parts = [self.micro(d) for d in range(self.parallel.dp)]
        return tuple(tuple(i for part in parts for i in part[m]) for m in range(self.spec.micro_batches))

    @property
    def parallel(self) -> ParallelConfig:
        return self.spec.parallel

    @property
    def dtype(self) -> torch.dtype:
        return self.cfg.dtype

    @property
    def optimizer(self) -> Optimizer:
        return OPTIMIZERS[self.spec.optimizer]

    @property
    def max_tokens_per_rank(self) -> int:
        """The rows of a DP rank's batch (its prompts, left-padded to its longest): what one MoE
        forward of a rank may see, for backends with fixed per-rank buffers."""
        return max(len(mine) * max(len(self.spec.prompts[i]) for i in mine) for mine in self.dp_prompts)


def build_schedule(spec: TrainSpec, optimizer: torch.optim.Optimizer,
                   steps_before: int = 0) -> torch.optim.lr_scheduler.LRScheduler:
    """The learning-rate schedule of ``spec`` over its steps, as the Trainer builds it
    (``transformers.get_scheduler``); stepped once after each optimizer step. A resumed run
    (``steps_before`` steps taken) schedules over ``steps_before + spec.steps`` steps and starts
    at step ``steps_before``."""
    import transformers

    schedule: torch.optim.lr_scheduler.LRScheduler = transformers.get_scheduler(
        spec.schedule, optimizer, num_warmup_steps=spec.warmup_steps, num_training_steps=steps_before + spec.steps)
    with warnings.catch_warnings():
        # Stepping the schedule to the resumed step before any optimizer step is the point here.
        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)`")
        for _ in range(steps_before):
            schedule.step()
    return schedule


def aux_loss_coef(model_dir: str) -> float | None:
    """The coefficient of the load-balancing loss transformers adds to this model's loss, or None
    where it adds none: the config turns it on (``output_router_logits``) and has a
    ``router_aux_loss_coef``, and the model's transformers module computes it (defines
    ``load_balancing_loss_func``; DeepSeek-V3 and Llama-4 do not, whatever their config says)."""
    import importlib

    import transformers

    config = transformers.AutoConfig.from_pretrained(model_dir)
    coef = getattr(config, "router_aux_loss_coef", None)
    if getattr(config, "output_router_logits", False) is not True or coef is None:
        return None
    from moeshard.checkpoint.hf_model import model_class

    cls = model_class(config)._model_mapping[type(config)]
    if not hasattr(importlib.import_module(cls.__module__), "load_balancing_loss_func"):
        return None
    return float(coef)


def plan_train(spec: TrainSpec) -> TrainPlan:
    """Checks everything that can be checked before processes start; returns the plan."""
    from moeshard.integrations.transformers import check_layout

    p = spec.parallel
    info = read_hf_config(spec.model_dir)
    raw, _, pad = check_prompts(spec.model_dir, spec.prompts, p.dp, spec.prompts_from)
    positions = raw.get("max_position_embeddings")
    longest = max(len(prompt) for prompt in spec.prompts)
    if is_int(positions) and longest > positions:
        raise ValueError(f"{spec.prompts_from}: the longest prompt has {longest} tokens, more than the model's "
                         f"max_position_embeddings={positions}")
    fewest = min(len(mine) for mine in split_prompts(len(spec.prompts), p.dp))
    if spec.micro_batches > fewest:
        raise ValueError(f"--micro-batches {spec.micro_batches}: a DP rank of the {p.dp} has only {fewest} prompt(s) "
                         f"of the {len(spec.prompts)} to split into micro-batches; give at most {fewest} micro-batches "
                         f"or more prompts")
    tokens = sum(len(prompt) - 1 for prompt in spec.prompts)
    if tokens == 0:
        raise ValueError(f"{spec.prompts_from}: every prompt is one token long, so there is no next token to predict; give "
                         f"prompts of two tokens or more (got {len(spec.prompts)} prompt(s))")
    quant = resolve_quant(info, spec.quant)
    dtype = parse_dtype(spec.dtype) if spec.dtype is not None else (info.checkpoint_dtype or torch.float32)
    cfg = info.moe_config(dtype)
    backend = check_layout(cfg, quant, p, spec.backend, spec.device)
    refusal = backward_refusal(backend, quant)
    if refusal:
        where = (f"--backend {backend}" if not quant.quantized else f"--quant {quant.scheme}" if spec.quant is not None
                 else f"the checkpoint's quantization {quant.scheme}")
        raise ValueError(f"train: {where}: {refusal}")
    for flag, wanted in (("--compare", spec.compare), ("--save", spec.save_dir is not None)):
        unloadable = transformers_refusal(spec.model_dir, flag) if wanted else None
        if unloadable:
            raise ValueError(unloadable)
    aux_coef = aux_loss_coef(spec.model_dir)
    if aux_coef is not None and info.family.experts_only:
        raise ValueError(f"{spec.model_dir}: config.json turns the load-balancing loss on (output_router_logits true), "
                         f"which moeshard train computes over the global batch from moeshard's routers; model_type "
                         f"{info.model_type!r} routes with transformers' routers (moeshard runs only its experts), so "
                         f"train it with output_router_logits false")
    steps_before, resumed_layout = _resumed(spec, backend, dtype)
    return TrainPlan(spec=spec, model_type=info.model_type, cfg=cfg, quant=quant, backend=backend, pad_token_id=pad,
                     dp_prompts=split_prompts(len(spec.prompts), p.dp), tokens=tokens,
                     aux_coef=aux_coef, steps_before=steps_before, resumed_layout=resumed_layout)


def _resumed(spec: TrainSpec, backend: str, dtype: torch.dtype) -> tuple[int, str | None]:
    """The steps the optimizer state ``--resume`` goes on from has taken and the layout that saved
    it ((0, None) without it), once the state is checked to be this run's: saved by the same
    optimizer (a whole state goes on under any layout; a per-rank one, ``save_rank_state``'s, only
    under the same layout, backend and dtype)."""
    from moeshard.training.optimizer_state import SUBDIR, read_meta

    if not spec.resume:
        return 0, None
    if spec.compare:
        raise ValueError("--resume with --compare: transformers alone would train from a fresh optimizer state, not "
                         "the saved one, so the two would not be the same training; compare without --resume")
    meta = read_meta(spec.model_dir)
    if meta is None:
        raise ValueError(f"--resume: {spec.model_dir} holds no optimizer state ({SUBDIR}/ with meta.json); a "
                         f"moeshard train --save directory does")
    p = spec.parallel
    refusal = meta.refusal(p.name, p.world_size, backend, spec.optimizer, dtype_name(dtype))
    if refusal:
        raise ValueError(f"--resume: the optimizer state in {spec.model_dir} was saved by another run: {refusal}; "
                         f"resume with the saving run's settings")
    total = meta.steps_done + spec.steps
    if spec.warmup_steps > total:
        raise ValueError(f"--warmup-steps: must be an integer in [0, {total}] (the {meta.steps_done} step(s) taken "
                         f"plus --steps={spec.steps}), got {spec.warmup_steps}")
    return meta.steps_done, meta.layout


# -- the batch --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Batch:
    """ids, mask: [B, L] left-padded (``generate``'s batch); labels: [B, L] the ids, IGNORE at
    padding and at each prompt's first token (no token before it predicts it); positions: [B, L]
    each token's position counted from its prompt's first token (0 on padding)."""

    ids: torch.Tensor
    mask: torch.Tensor
    labels: torch.Tensor
    positions: torch.Tensor

    @classmethod
    def of(cls, prompts: list[tuple[int, ...]], pad: int, device) -> Batch:
        ids, mask = padded_batch(prompts, pad, device)
        count = mask.cumsum(-1)
        labels = ids.masked_fill((mask == 0) | (count == 1), IGNORE)
        return cls(ids, mask, labels, (count - 1).clamp(min=0))

    def loss(self, model: nn.Module, tokens: int) -> torch.Tensor:
        """fp32 []: transformers' next-token loss of this batch as a share of ``tokens`` (the sum
        of its tokens' cross entropies / tokens: ``num_items_in_batch``), its auxiliary loss off."""
        out = model(self.ids, attention_mask=self.mask, position_ids=self.positions, labels=self.labels,
                    num_items_in_batch=tokens, output_router_logits=False, use_cache=False)
        return out.loss


# -- on a rank --------------------------------------------------------------------------------
@dataclass(frozen=True)
class TrainRankResult:
    """One rank's report. prompts: the prompt indices it trained on (its DP rank's); losses[s]:
    its L_d in the forward of step s (the same on the TP ranks of one DP rank; summed over its
    micro-batches); aux_losses[s]: the load-balancing loss over the global batch at step s (the
    mean of its micro-batches'; None without one); grad_norm: the norm of the last step's reduced
    gradients, before any clipping (every parameter counted once, the same on every
    rank); experts: [start, stop) of its experts, intermediate: its [lo, hi) of I; params: with
    ``spec.sends_parameters``, its trained parameters after the last step (CPU fp32, by name; experts its
    shard), else None; shards: each MoE block's module name -> its ``ShardSpec``; buffers: with
    ``spec.save_dir``, its floating-point buffers (CPU fp32, by name: a selection bias that
    transformers holds as a parameter, AFMoE's ``expert_bias``, is one), else None;
    learning_rates[s]: the rate step s updated with (the schedule's value then); optimizer_state:
    with ``spec.save_dir``, its optimizer state after the last step
    (``optimizer_state.rank_state``), else None."""

    rank: int
    dp_rank: int
    tp_rank: int
    prompts: tuple[int, ...]
    losses: tuple[float, ...]
    aux_losses: tuple[float, ...] | None
    grad_norm: float
    experts: tuple[int, int]
    intermediate: tuple[int, int]
    expert_bytes: int
    load_s: float
    train_s: float
    params: dict[str, torch.Tensor] | None
    shards: dict[str, ShardSpec]
    buffers: dict[str, torch.Tensor] | None = None
    learning_rates: tuple[float, ...] = ()
    optimizer_state: dict[str, torch.Tensor] | None = None


def train_rank(plan: TrainPlan, groups: ParallelGroups | None) -> TrainRankResult:
    """Runs ``plan`` on this rank (groups None: the single-rank layout, no process group)."""
    from moeshard.integrations.transformers import expert_bytes
    from moeshard.layer import MoELayer
    from moeshard.training import clip_grad_norm_, grad_norm, reduce_gradients
    from moeshard.training.router_losses import keep_router_logits, load_balancing_loss

    spec = plan.spec
    place = RankPlace.of(plan, groups)
    rank, dp_rank, tp_rank, device = place.rank, place.dp_rank, place.tp_rank, place.device
    model, load_s = load_timed(plan, groups, device)
    model.requires_grad_(True)
    if plan.aux_coef is not None:
        keep_router_logits(model)
    mine = plan.dp_prompts[dp_rank]
    micro = [Batch.of([spec.prompts[i] for i in part], plan.pad_token_id, device) for part in plan.micro(dp_rank)]
    optimizer = plan.optimizer.build([q for q in model.parameters() if q.requires_grad], spec.lr)
    if spec.resume:
        meta = optimizer_state.read_meta(spec.model_dir)
        if meta is not None and meta.whole:  # whole tensors: this rank takes its part, whatever layout saved them
            optimizer_state.load_sharded_optimizer(optimizer, model, spec.model_dir)
        else:
            optimizer_state.load_rank_state(optimizer, model, spec.model_dir, rank)
    schedule = build_schedule(spec, optimizer, plan.steps_before)
    losses: list[float] = []
    aux_losses: list[float] = []
    rates: list[float] = []
    norm = torch.zeros(())
    if groups is not None:
        dist.barrier()
    t1 = time.perf_counter()
    for _ in range(spec.steps):
        optimizer.zero_grad(set_to_none=True)
        rates.append(float(optimizer.param_groups[0]["lr"]))
        parts, aux_parts = [], []  # each micro-batch's loss and load-balancing loss, read once a step
        for batch in micro:  # gradients accumulate over the micro-batches; reduced once after them
            loss = batch.loss(model, plan.tokens)
            if plan.aux_coef is not None:
                # The step's load-balancing loss is the mean of its micro-batches' (each over the
                # global micro-batch), as the cross entropies sum to the whole batch's.
                aux = load_balancing_loss(model, groups, row_mask=batch.mask.reshape(-1))
                loss = loss + plan.aux_coef * aux.share / len(micro)
                aux_parts.append(aux.value.detach().float().reshape(()))
            loss.backward()
            parts.append(loss.detach().float().reshape(()))
        reduce_gradients(model, groups)
        norm = (clip_grad_norm_(model, groups, spec.max_grad_norm) if spec.max_grad_norm is not None
                else grad_norm(model, groups))
        optimizer.step()
        schedule.step()
        losses.append(math.fsum(torch.stack(parts).tolist()))
        if plan.aux_coef is not None:
            aux_losses.append(math.fsum(torch.stack(aux_parts).tolist()) / len(micro))
    synchronize(device)
    train_s = time.perf_counter() - t1
    blocks = {name: m for name, m in model.named_modules() if isinstance(m, MoELayer)}
    s = next(iter(blocks.values())).shard
    width = plan.cfg.intermediate_size // s.tp_size
    params = None
    if spec.sends_parameters:
        params = {name: q.detach().float().cpu() for name, q in model.named_parameters() if q.requires_grad}
    buffers = state = None
    if spec.save_dir is not None:
        buffers = {name: b.detach().float().cpu() for name, b in model.named_buffers() if b.is_floating_point()}
        state = optimizer_state.rank_state(optimizer, model)
    return TrainRankResult(rank=rank, dp_rank=dp_rank, tp_rank=tp_rank, prompts=mine, losses=tuple(losses),
                           learning_rates=tuple(rates),
                           aux_losses=tuple(aux_losses) if plan.aux_coef is not None else None,
                           grad_norm=float(norm), experts=(s.expert_start, s.expert_stop),
                           intermediate=(s.tp_rank * width, (s.tp_rank + 1) * width), expert_bytes=expert_bytes(model),
                           load_s=load_s, train_s=train_s, params=params,
                           shards={name: m.shard for name, m in blocks.items()}, buffers=buffers,
                           optimizer_state=state)


def train_plans(plans: list[TrainPlan]) -> list[TrainRankResult | dict]:
    """``spawn`` entry: every plan in order on this rank (all plans need this world size); a plan
    that raises is recorded as ``{"error": type name, "message": ...}``. On CPU the machine's
    cores are shared out between the local ranks, as ``generate_plans`` does."""
    if plans and plans[0].spec.device == "cpu" and dist.is_initialized():
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // dist.get_world_size()))
    return each_plan(plans, train_rank)


def global_losses(plan: TrainPlan, results: list[TrainRankResult]) -> list[float]:
    """The loss before each step: the sum over DP ranks of L_d (each DP rank's TP rank 0)."""
    firsts = [r for r in results if r.tp_rank == 0]
    if sorted(r.dp_rank for r in firsts) != list(range(plan.parallel.dp)):
        raise RuntimeError(f"expected one report from each DP rank's TP rank 0, got DP ranks "
                           f"{sorted(r.dp_rank for r in firsts)}")
    return [math.fsum(r.losses[s] for r in firsts) for s in range(plan.spec.steps)]


def tp_loss_spread(results: list[TrainRankResult]) -> float:
    """The largest |L_d| difference between a TP rank and its TP rank 0 at any step (0 when the TP
    ranks of every DP rank computed the same loss, as the replicated loss needs)."""
    first = {r.dp_rank: r.losses for r in results if r.tp_rank == 0}
    return max((abs(a - b) for r in results for a, b in zip(r.losses, first[r.dp_rank], strict=True)), default=0.0)


# -- transformers alone -----------------------------------------------------------------------
@dataclass(frozen=True)
class TrainReference:
    """transformers alone on one device: losses[s] its loss before step s (with its own
    auxiliary loss where the config turns it on), aux_losses[s] that auxiliary loss (None
    without), grad_norm the norm of the last step's gradients, params every parameter after the
    last step (CPU fp32, transformers' names and layouts), dtype the dtype it ran in."""

    losses: tuple[float, ...]
    aux_losses: tuple[float, ...] | None
    grad_norm: float
    params: dict[str, torch.Tensor]
    dtype: torch.dtype


def reference_train(plan: TrainPlan, device: str | torch.device | None = None,
                    dtype: torch.dtype = torch.float32) -> TrainReference:
    """The same steps with transformers alone (``from_pretrained`` in ``dtype``; every expert,
    no moeshard) on one device: the whole batch (every prompt, left-padded to the longest; with
    micro-batches, each global micro-batch so), the same labels and positions, transformers' own
    loss (``labels`` as a share of the global token count, and its load-balancing loss where the
    config turns it on, weighing 1/M with M micro-batches), the same optimizer, learning-rate
    schedule (``build_schedule``) and clipping (``torch.nn.utils.clip_grad_norm_``).

    dtype: torch.float32 (the reference) or torch.float64 (near-exact arithmetic, against which
    float32 rounding is measured). A float64 run keeps the float32 casts transformers writes into
    its models (RMSNorm, router softmax, the loss's logits; some router weights stay float32);
    measured over tests/test_train_families.py, they move its third loss by at most 4.2e-5
    (jamba; 8.4e-6 elsewhere) from a run with every one of them in float64, within
    ``TRAIN_LOSS_RTOL``."""
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"reference_train: dtype must be torch.float32 or torch.float64, got {dtype!r}")
    device = torch.device(device if device is not None else ("cuda" if plan.spec.device == "cuda" else "cpu"))
    model: nn.Module = load_transformers_model(plan.spec.model_dir, dtype)
    model = model.to(device).eval().requires_grad_(True)
    spec = plan.spec
    micro = [Batch.of([spec.prompts[i] for i in part], plan.pad_token_id, device) for part in plan.global_micro()]
    params = [q for q in model.parameters() if q.requires_grad]
    optimizer = plan.optimizer.build(params, spec.lr)
    schedule = build_schedule(spec, optimizer)
    losses: list[float] = []
    aux_losses: list[float] = []
    norm = torch.zeros(())
    for _ in range(spec.steps):
        optimizer.zero_grad(set_to_none=True)
        step_loss, step_aux, has_aux = 0.0, 0.0, False
        for batch in micro:
            out = model(batch.ids, attention_mask=batch.mask, position_ids=batch.positions, labels=batch.labels,
                        num_items_in_batch=plan.tokens, use_cache=False)
            loss = out.loss
            if getattr(out, "aux_loss", None) is not None:
                has_aux = True
                step_aux += float(out.aux_loss.detach()) / len(micro)
                if plan.aux_coef is not None and len(micro) > 1:
                    # transformers adds coef x the micro-batch's whole auxiliary loss; the step's is
                    # the mean over its micro-batches (``train_rank``).
                    loss = loss - (1 - 1 / len(micro)) * plan.aux_coef * out.aux_loss
            loss.backward()
            step_loss += float(loss.detach())
        if spec.max_grad_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(params, spec.max_grad_norm)
        else:
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(q.grad.float()) for q in params
                                                         if q.grad is not None]))
        optimizer.step()
        schedule.step()
        losses.append(step_loss)
        if has_aux:
            aux_losses.append(step_aux)
    return TrainReference(losses=tuple(losses), aux_losses=tuple(aux_losses) if aux_losses else None,
                          grad_norm=float(norm),
                          params={name: q.detach().float().cpu() for name, q in model.named_parameters()},
                          dtype=dtype)


@dataclass(frozen=True)
class TrainComparison:
    """moeshard against transformers alone. loss_rel_diff[s]: |loss - transformers' loss| /
    |transformers' loss| before step s; within_tolerance: every one at most ``rtol`` (None for a
    run not in fp32, whose rounding is not judged: the reference is fp32); grad_norm_rel_diff:
    the same for the last step's gradient norm; max_abs_param_diff: the largest |parameter -
    transformers' parameter| after the last step over every parameter of every rank, at
    ``param_diff_at`` ("name on rank r"); params_compared: the (rank, parameter) pairs compared.

    Measured only when transformers' float64 run is given (else None): exact_losses[s] its loss
    before step s; exact_loss_rel_diff[s]: |loss - float64 loss| / |float64 loss|; noise[s]:
    |transformers' float32 loss - its float64 loss| / |float64 loss|, how far float32 rounding
    alone moves this training by step s (a flipped top-k choice, or AdamW turning a near-zero
    gradient into a full step of either sign, makes it grow with the steps);
    within_noise (fp32 runs): every exact_loss_rel_diff[s] at most ``train_bound(rtol,
    noise[s])``."""

    losses: tuple[float, ...]
    aux_losses: tuple[float, ...] | None
    loss_rel_diff: tuple[float, ...]
    rtol: float
    within_tolerance: bool | None
    grad_norm: float
    grad_norm_rel_diff: float
    max_abs_param_diff: float
    param_diff_at: str
    params_compared: int
    exact_losses: tuple[float, ...] | None = None
    exact_loss_rel_diff: tuple[float, ...] | None = None
    noise: tuple[float, ...] | None = None
    within_noise: bool | None = None

    @property
    def max_loss_rel_diff(self) -> float:
        return max(self.loss_rel_diff)

    def to_json(self) -> dict:
        return {"transformers_losses": list(self.losses),
                "transformers_aux_losses": None if self.aux_losses is None else list(self.aux_losses),
                "loss_rel_diff": list(self.loss_rel_diff), "max_loss_rel_diff": self.max_loss_rel_diff,
                "tolerance_rel": self.rtol, "within_tolerance": self.within_tolerance,
                "transformers_grad_norm": self.grad_norm, "grad_norm_rel_diff": self.grad_norm_rel_diff,
                "max_abs_param_diff": self.max_abs_param_diff, "param_diff_at": self.param_diff_at,
                "params_compared": self.params_compared,
                "transformers_float64_losses": None if self.exact_losses is None else list(self.exact_losses),
                "loss_rel_diff_float64": None if self.exact_loss_rel_diff is None else list(self.exact_loss_rel_diff),
                "transformers_float32_vs_float64_loss_rel": None if self.noise is None else list(self.noise),
                "within_rounding_noise": self.within_noise}


def _rel(a: float, b: float) -> float:
    if a == b:
        return 0.0
    return abs(a - b) / abs(b) if b != 0 else math.inf


def compare_training(plan: TrainPlan, results: list[TrainRankResult], reference: TrainReference,
                     exact: TrainReference | None = None) -> TrainComparison:
    """Compares the losses before every step (the sum of the DP ranks' shares), the last step's
    gradient norm, and every parameter of every rank after the last step with ``reference``.
    ``exact``, transformers' float64 run of the same steps (``reference_train(plan,
    dtype=torch.float64)``, ``reference`` then being its float32 run): the losses are also judged
    against it, allowing for the float32 rounding this training amplifies (``TrainComparison``'s
    noise and within_noise).

    The parameters: each rank's own copy of every trained parameter is compared with the same
    part of transformers' trained tensor, so each element of a routed expert is compared on the
    rank that owns it (its expert under EP, its slice of I under TP, on every DP rank that holds
    it) and each replicated parameter on every rank (their copies must be the same). transformers'
    expert tensors are first put in moeshard's canonical layout (``MoEWeights``: gate_up [E, 2I, H],
    down [E, H, I]), then sliced as the rank's ``ShardSpec`` says (``training.reference.shard_of_grad``)."""
    if exact is not None:
        _check_exact("compare_training", reference, exact)
    if any(r.params is None for r in results):
        raise ValueError("compare_training: the ranks sent no parameters (TrainSpec.compare and save_dir were unset)")
    losses = global_losses(plan, results)
    rel = tuple(_rel(a, b) for a, b in zip(losses, reference.losses, strict=True))
    want = RankParts(read_hf_config(plan.spec.model_dir).family, plan.cfg, reference.params)
    worst, at, count = 0.0, "", 0
    for r in results:
        assert r.params is not None  # checked above
        for name, got in r.params.items():
            ref = want.of(name, r.shards)
            if tuple(ref.shape) != tuple(got.shape):
                raise RuntimeError(f"rank {r.rank}: parameter {name} is {tuple(got.shape)}, transformers' part of it "
                                   f"{tuple(ref.shape)}")
            diff = float((got - ref).abs().max()) if got.numel() else 0.0
            count += 1
            if not diff <= worst:  # NaN counts as the worst
                worst, at = diff, f"{name} on rank {r.rank}"
    within = all(v <= TRAIN_LOSS_RTOL for v in rel) if plan.dtype == torch.float32 else None
    comparison = TrainComparison(losses=reference.losses, aux_losses=reference.aux_losses, loss_rel_diff=rel,
                                 rtol=TRAIN_LOSS_RTOL, within_tolerance=within, grad_norm=reference.grad_norm,
                                 grad_norm_rel_diff=_rel(results[0].grad_norm, reference.grad_norm),
                                 max_abs_param_diff=worst, param_diff_at=at, params_compared=count)
    return comparison if exact is None else against_exact(comparison, plan, results, reference, exact)


def _check_exact(where: str, reference: TrainReference, exact: TrainReference) -> None:
    if exact.dtype != torch.float64 or reference.dtype != torch.float32:
        raise ValueError(f"{where}: exact must be transformers' float64 run and reference its float32 run, "
                         f"got exact.dtype={exact.dtype} and reference.dtype={reference.dtype}")


def against_exact(comparison: TrainComparison, plan: TrainPlan, results: list[TrainRankResult],
                  reference: TrainReference, exact: TrainReference) -> TrainComparison:
    """``comparison`` (``compare_training`` against ``reference``, transformers' float32 run)
    with the losses also judged against ``exact``, its float64 run of the same steps
    (``TrainComparison``'s exact fields, noise and within_noise); the parameters, compared once,
    are kept as they are."""
    _check_exact("against_exact", reference, exact)
    losses = global_losses(plan, results)
    exact_rel = tuple(_rel(a, b) for a, b in zip(losses, exact.losses, strict=True))
    noise = tuple(_rel(a, b) for a, b in zip(reference.losses, exact.losses, strict=True))
    within_noise = None
    if plan.dtype == torch.float32:  # NaN anywhere fails the comparison
        within_noise = all(d <= train_bound(TRAIN_LOSS_RTOL, n) for d, n in zip(exact_rel, noise, strict=True))
    return replace(comparison, exact_losses=exact.losses, exact_loss_rel_diff=exact_rel, noise=noise,
                   within_noise=within_noise)


def describe(plan: TrainPlan) -> dict:
    """The plan as JSON-able fields (for the summary and ``--output``)."""
    spec, opt = plan.spec, plan.optimizer
    return {"model": spec.model_dir, "model_type": plan.model_type, "layout": plan.parallel.name,
            "world_size": plan.parallel.world_size, "device": spec.device, "backend": plan.backend,
            "quant": plan.quant.name, "dtype": dtype_name(plan.dtype), "steps": spec.steps,
            "optimizer": {"name": opt.name, "torch": f"torch.optim.{opt.cls}", "lr": spec.lr,
                          **{k: list(v) if isinstance(v, tuple) else v for k, v in opt.settings.items()}},
            "lr_schedule": spec.schedule, "warmup_steps": spec.warmup_steps, "max_grad_norm": spec.max_grad_norm,
            "micro_batches": spec.micro_batches, "saved_to": spec.save_dir,
            "resumed_after_step": plan.steps_before if spec.resume else None,
            "resumed_from_layout": plan.resumed_layout,
            "prompts_per_micro_batch": [[list(part) for part in plan.micro(d)] for d in range(plan.parallel.dp)],
            "tokens": plan.tokens, "aux_loss_coef": plan.aux_coef,
            "prompts_per_dp_rank": [list(d) for d in plan.dp_prompts]}
