"""What ``moeshard run`` does: plan once (no processes yet), then run the plan on every rank.

    plan_run(RunSpec)            parent, before any process starts: reads config.json (or the
                                 preset) and the input's header, resolves dtype, quant, backend,
                                 token split; refuses anything wrong with a ValueError
    run_rank(RunPlan, groups)    every rank: load its share (checkpoint slices, or random weights
                                 from the seed), all ranks agree that loading worked, read its DP
                                 rank's rows of the input, forward, all-gather the outputs over DP
                                 -> RunRankResult (rank 0 holds the output of all T tokens, in order)
    run_plans(plans)             ``spawn`` entry: runs several plans on one set of ranks

Tokens: the input holds the global tokens ``hidden_states [T, H]``. DP rank d gets rows
``[sum(n[:d]), sum(n[:d+1]))`` with ``n = tokens_per_rank`` (default: an even split, the first
``T % dp`` DP ranks one more); the TP ranks of a DP rank share its rows. A generated input is
made in blocks of ``ROW_BLOCK`` rows, each from its own seed, so a rank generates only the
blocks that hold its rows, never all T.

Bounds checked before any process starts: ``estimate_memory`` (what the ranks and the parent
will hold) against the available memory, and every size against ``validate.MAX_DIM``.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.distributed as dist

from moeshard.checkpoint.hf_config import HFMoEModel, read_hf_config
from moeshard.checkpoint.loader import load_moe_block, resolve_quant
from moeshard.checkpoint.reader import INDEX_FILE, open_safetensors
from moeshard.config import MODEL_DTYPES, MoEConfig, QuantConfig, dtype_name, parse_dtype
from moeshard.dispatch.registry import default_backend, support
from moeshard.errors import RankFailed
from moeshard.experts.base import ExpertWeights
from moeshard.jobs.world import RankPlace, each_plan, synchronize
from moeshard.parallel.agree import first_failure
from moeshard.parallel.collectives import all_gatherv
from moeshard.parallel.config import ParallelConfig
from moeshard.parallel.groups import ParallelGroups
from moeshard.parallel.trace import TRACE_CAPACITY, CollectiveTrace
from moeshard.presets import get_preset
from moeshard.sharding import shard_spec
from moeshard.validate import MAX_DIM, is_int
from moeshard.validate import seed as check_seed
from moeshard.weights import MoEWeights

INPUT_KEY = "hidden_states"
ROW_BLOCK = 1024  # rows of a generated input made from one seed


@dataclass(frozen=True)
class RunSpec:
    """What the user asked for (the command line, as data).

    Exactly one of ``model_dir`` (a Hugging Face directory; ``layer`` picks the block) and
    ``preset`` (random weights of a ``moeshard.presets`` shape, ``preset_size`` small|full, from
    ``seed``). ``input_path``: safetensors with ``hidden_states [T, H]``; without it ``num_tokens``
    rows are generated from ``seed``. ``quant``/``dtype``/``backend`` None: automatic (the
    checkpoint's own quantization and dtype, the layout's default backend).
    ``tokens_per_rank``: rows per DP rank (must sum to T); None: even split.
    """

    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    model_dir: str | None = None
    layer: int | None = None
    preset: str | None = None
    preset_size: str = "small"
    seed: int = 0
    input_path: str | None = None
    num_tokens: int = 16
    tokens_per_rank: tuple[int, ...] | None = None
    quant: str | None = None
    defer_input_quant: bool = False
    shared_quant: str = "none"
    dtype: str | None = None
    backend: str | None = None
    device: str = "cpu"

    def __post_init__(self) -> None:
        if (self.model_dir is None) == (self.preset is None):
            raise ValueError("run: give exactly one of a model directory (--model) and a preset (--random), got "
                             f"model={self.model_dir!r}, random={self.preset!r}")
        if self.model_dir is not None and self.layer is None:
            raise ValueError("run: --model needs --layer (the index of the decoder layer whose MoE block to run)")
        if self.preset is not None and self.layer is not None:
            raise ValueError(f"run: --layer {self.layer} picks a decoder layer of --model; --random "
                             f"{self.preset} is one random MoE block and takes no --layer")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"run: device must be 'cpu' or 'cuda', got {self.device!r}")
        if not is_int(self.num_tokens) or not 0 <= self.num_tokens <= MAX_DIM:
            raise ValueError(f"run: --tokens must be an integer in [0, {MAX_DIM}], got {self.num_tokens!r}")
        check_seed("", "--seed", self.seed)


@dataclass(frozen=True)
class RunPlan:
    """A checked, fully resolved run; every rank executes the same plan.

    cfg: the block (dtype resolved); quant; backend; tokens_per_rank: rows per DP rank;
    total_tokens: T; source: one line saying what runs; generated_input: True when the input
    comes from the seed rather than a file.
    """

    spec: RunSpec
    cfg: MoEConfig
    quant: QuantConfig
    backend: str
    tokens_per_rank: tuple[int, ...]
    total_tokens: int
    source: str
    generated_input: bool

    @property
    def parallel(self) -> ParallelConfig:
        return self.spec.parallel

    def row_range(self, dp_rank: int) -> tuple[int, int]:
        start = sum(self.tokens_per_rank[:dp_rank])
        return start, start + self.tokens_per_rank[dp_rank]


@dataclass(frozen=True)
class RunRankResult:
    """One rank's report. experts: [start, stop) of the experts it holds; intermediate: its
    [lo, hi) of I; tokens: its DP rank's rows; load_s / forward_s: seconds; output: rank 0 only,
    ``[T, H]`` in the model dtype on CPU, all tokens in input order (None elsewhere)."""

    rank: int
    dp_rank: int
    tp_rank: int
    tokens: int
    experts: tuple[int, int]
    intermediate: tuple[int, int]
    load_s: float
    forward_s: float
    output: torch.Tensor | None


def split_tokens(total: int, dp: int, given: tuple[int, ...] | None = None,
                 source: str = "the input has") -> tuple[int, ...]:
    """Rows per DP rank: ``given`` (checked: dp entries >= 0 summing to total) or an even split
    with the first ``total % dp`` ranks getting one more. ``source`` says where ``total`` came
    from, for the refusal ("the input has", "--tokens asks for")."""
    if given is None:
        return tuple(total // dp + (1 if d < total % dp else 0) for d in range(dp))
    given = tuple(given)
    if len(given) != dp or any(not is_int(n) or n < 0 for n in given):
        raise ValueError(f"--tokens-per-rank: expected {dp} integers >= 0 (one per DP rank), got {list(given)}")
    if sum(given) != total:
        raise ValueError(f"--tokens-per-rank: {list(given)} sums to {sum(given)}, but {source} T={total} tokens")
    return given


def _open_input(path: str):
    return open_safetensors(path, "input file")


def input_header(path: str) -> tuple[tuple[int, ...], str]:
    """(shape, safetensors dtype string) of the input's ``hidden_states``, from the header only."""
    with _open_input(path) as f:
        if INPUT_KEY not in set(f.keys()):
            raise ValueError(f"input file {path!r} has no tensor {INPUT_KEY!r} (it has {sorted(f.keys())[:8]})")
        sl = f.get_slice(INPUT_KEY)
        return tuple(sl.get_shape()), sl.get_dtype()


def read_input_rows(path: str, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows [start, stop) of ``hidden_states`` in ``dtype``, an owned copy (only those rows are read)."""
    with _open_input(path) as f:
        rows = f.get_slice(INPUT_KEY)[start:stop]
        out = rows.to(dtype=dtype, copy=True, memory_format=torch.contiguous_format)
    if not bool(torch.isfinite(out).all()):
        raise ValueError(f"input file {path!r}: {INPUT_KEY} rows [{start}, {stop}) hold NaN/Inf")
    return out


def _block_generator(seed: int, block: int) -> torch.Generator:
    digest = hashlib.blake2b(f"moeshard-run-input:{seed}:{block}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little"))


def random_hidden_states(num_tokens: int, hidden_size: int, seed: int, dtype: torch.dtype,
                         start: int = 0, stop: int | None = None) -> torch.Tensor:
    """Rows ``[start, stop)`` (default all) of the generated input ``[T, H]``, standard normal.

    Block ``b`` (rows ``[b * ROW_BLOCK, ...)``, the last one shorter) comes from its own seed, a
    hash of ``seed`` and ``b``, so any slice is generated from the blocks it touches alone, and
    every rank's slice equals the same rows of the whole input."""
    stop = num_tokens if stop is None else stop
    if not 0 <= start <= stop <= num_tokens:
        raise ValueError(f"random_hidden_states: rows [{start}, {stop}) outside [0, {num_tokens})")
    out = torch.empty(stop - start, hidden_size, dtype=dtype)
    for block in range(start // ROW_BLOCK, -(-stop // ROW_BLOCK)):
        lo = block * ROW_BLOCK
        rows = min(ROW_BLOCK, num_tokens - lo)
        values = torch.randn(rows, hidden_size, generator=_block_generator(seed, block))
        a, b = max(start, lo), min(stop, lo + rows)
        out[a - start:b - start] = values[a - lo:b - lo].to(dtype)
    return out


def random_weights(cfg: MoEConfig, seed: int) -> MoEWeights:
    """Full random weights of ``cfg`` from ``seed`` (identical on every rank)."""
    return MoEWeights.random(cfg, generator=torch.Generator().manual_seed(seed))


def plan_run(spec: RunSpec) -> RunPlan:
    """Checks everything that can be checked before processes start; returns the plan."""
    p = spec.parallel
    model: HFMoEModel | None = None
    if spec.model_dir is not None:
        assert spec.layer is not None  # RunSpec refuses a model directory without a layer
        model = read_hf_config(spec.model_dir)
        if model.family.experts_only:
            raise ValueError(f"{spec.model_dir}: model_type {model.model_type!r} routes with transformers' router, on "
                             f"inputs its experts do not take (Gemma 4's router norm and scales, DeepSeek-V4's token "
                             f"ids, ZAYA's router state from the layer before), which moeshard run does not compute "
                             f"for one block alone; run the whole model with moeshard generate or train")
        model.check_layer(spec.layer)
        quant = resolve_quant(model, spec.quant)
        base_cfg = model.moe_config()
        source = f"{model.model_type} {spec.model_dir} layer {spec.layer}"
    else:
        assert spec.preset is not None  # RunSpec holds exactly one of model_dir and preset
        preset = get_preset(spec.preset)
        base_cfg = preset.config(spec.preset_size)
        quant = QuantConfig(spec.quant or "none")
        source = f"random {preset.name} ({spec.preset_size}), seed {spec.seed}"
    quant = QuantConfig(quant.scheme, defer_input_quant=spec.defer_input_quant, shared=spec.shared_quant)

    if spec.input_path is not None:
        shape, st_dtype = input_header(spec.input_path)
        if len(shape) != 2 or shape[1] != base_cfg.hidden_size:
            raise ValueError(f"input file {spec.input_path!r}: {INPUT_KEY} must be [T, hidden_size={base_cfg.hidden_size}], "
                             f"got {list(shape)}")
        total = shape[0]
        in_dtype = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}.get(st_dtype)
        if st_dtype not in ("F32", "BF16", "F16", "F64"):
            raise ValueError(f"input file {spec.input_path!r}: {INPUT_KEY} has dtype {st_dtype}, expected a float dtype")
    else:
        total, in_dtype = spec.num_tokens, None

    # dtype: asked for > the input's > the checkpoint's declared dtype > the preset's (fp32).
    if spec.dtype is not None:
        dtype = parse_dtype(spec.dtype)
    elif in_dtype is not None:
        dtype = MODEL_DTYPES[in_dtype]
    elif model is not None and model.checkpoint_dtype is not None:
        dtype = model.checkpoint_dtype
    else:
        dtype = base_cfg.dtype
    cfg = replace(base_cfg, dtype=dtype)

    p.validate(p.world_size, cfg)
    quant.check_model(cfg, "--shared-quant")
    backend = spec.backend or default_backend(p)
    ok, reason = support(backend, quant, p)
    if not ok:
        raise ValueError(f"backend {backend!r} cannot run layout {p.name} with quant {quant.scheme!r}: {reason}")
    # Every rank's shard passes the same checks (one expert block size, one slice width): the first
    # and the last stand for all, so no loop runs over a world size the caller has not bounded yet.
    for rank in {0, p.world_size - 1}:
        shard_spec(p, rank, cfg.num_experts).validate(cfg, quant)
    tokens = split_tokens(total, p.dp, spec.tokens_per_rank,
                          "the input has" if spec.input_path is not None else "--tokens asks for")
    return RunPlan(spec=spec, cfg=cfg, quant=quant, backend=backend, tokens_per_rank=tokens, total_tokens=total,
                   source=source, generated_input=spec.input_path is None)


# -- on every rank ----------------------------------------------------------------------------
def _agree(groups: ParallelGroups | None, error: BaseException | None, rank: int) -> None:
    """All ranks learn whether any rank failed to load, before the layer's first collective, so
    a rank that cannot load makes every rank raise (with that rank's reason) instead of leaving
    the others waiting. The reasons travel as (kind, text) strings between our own ranks; a
    ValueError (a refusal of bad input) stays a ValueError everywhere, anything else becomes a
    RankFailed (exit code 4 on the command line)."""
    # Imported here, as MoELayer is in run_rank: the parent that plans the run never needs it.

    failure = first_failure(groups, error, rank)
    if failure is not None:
        kind, text, failed = failure
        also = f" (ranks that failed to load: {failed})" if len(failed) > 1 else ""
        if kind == "ValueError":
            raise ValueError(text + also) from error
        raise RankFailed(f"{kind}: {text}{also}") from error


def _load(plan: RunPlan, rank: int) -> tuple[MoEWeights, ExpertWeights | None, ExpertWeights | None]:
    """(weights, local_experts, shared_stored) for ``MoELayer``: checkpoint slices (and the
    shared MLP as stored, see ``LoadedBlock``), or full random weights."""
    spec = plan.spec
    if spec.model_dir is not None:
        assert spec.layer is not None  # RunSpec refuses a model directory without a layer
        block = load_moe_block(spec.model_dir, spec.layer, parallel=plan.parallel, rank=rank, quant=plan.quant,
                               dtype=plan.cfg.dtype)
        return block.weights, block.local_experts, block.shared_stored
    return random_weights(plan.cfg, spec.seed), None, None


def _input_rows(plan: RunPlan, dp_rank: int) -> torch.Tensor:
    start, stop = plan.row_range(dp_rank)
    if plan.spec.input_path is not None:
        return read_input_rows(plan.spec.input_path, start, stop, plan.cfg.dtype)
    return random_hidden_states(plan.total_tokens, plan.cfg.hidden_size, plan.spec.seed, plan.cfg.dtype, start, stop)


def run_rank(plan: RunPlan, groups: ParallelGroups | None) -> RunRankResult:
    """Runs ``plan`` on this rank (groups None: the single-rank layout, no process group)."""
    from moeshard.layer import MoELayer

    p = plan.parallel
    place = RankPlace.of(plan, groups)
    rank, dp_rank, tp_rank, device = place.rank, place.dp_rank, place.tp_rank, place.device
    t0 = time.perf_counter()
    error, weights, local, shared_stored = None, None, None, None
    try:
        weights, local, shared_stored = _load(plan, rank)
        x = _input_rows(plan, dp_rank).to(device)
    except Exception as exc:  # noqa: BLE001 - every rank must hear of it (see _agree)
        error = exc
    _agree(groups, error, rank)
    layer = MoELayer(plan.cfg, quant=plan.quant, groups=groups, backend=plan.backend, weights=weights,
                     local_experts=local, device=device, max_tokens_per_rank=max(max(plan.tokens_per_rank), 1),
                     shared_stored=shared_stored)
    del weights, local, shared_stored
    synchronize(device)
    load_s = time.perf_counter() - t0
    if groups is not None:
        dist.barrier()
    t1 = time.perf_counter()
    with torch.no_grad():
        out = layer(x)
    synchronize(device)
    forward_s = time.perf_counter() - t1
    if p.dp > 1:
        # Every TP column gathers over its own DP group (all ranks take part, none waits alone);
        # rank 0's group holds DP ranks 0..dp-1 in order, so its result is all T tokens in order.
        assert groups is not None  # dp > 1: a world of several ranks, which runs with its groups
        out = all_gatherv(out, list(plan.tokens_per_rank), groups.dp_group, "dp")
    spec = layer.shard
    width = plan.cfg.intermediate_size // spec.tp_size
    return RunRankResult(rank=rank, dp_rank=dp_rank, tp_rank=tp_rank, tokens=plan.tokens_per_rank[dp_rank],
                      experts=(spec.expert_start, spec.expert_stop),
                      intermediate=(spec.tp_rank * width, (spec.tp_rank + 1) * width),
                      load_s=load_s, forward_s=forward_s, output=out.cpu() if rank == 0 else None)


def run_plans(plans: list[RunPlan], traces: list | None = None) -> list[RunRankResult | dict]:
    """``spawn`` entry: every plan in order on this rank (all plans need this world size).

    A plan that raises is recorded as ``{"error": type name, "message": ...}`` and the next plan
    runs; groups are built once per layout and reused. traces: one shared buffer per rank
    (``CollectiveTrace.shared``), or None; rank r records the collectives it enters into
    ``traces[r]``, plan i as case i, so that the parent can say where the ranks part on failure.
    """
    trace = None if traces is None else CollectiveTrace(TRACE_CAPACITY, traces[dist.get_rank()])
    return each_plan(plans, run_rank, trace)


def describe(plan: RunPlan) -> dict[str, str]:
    """The plan in words (for the summary and the output file's metadata)."""
    p, q = plan.parallel, plan.quant
    return {"source": plan.source, "layout": p.name, "backend": plan.backend,
            "quant": q.scheme + (" (deferred input quantization)" if q.defer_input_quant else "")
            + ("" if q.shared == "none" else f", shared experts {q.shared}"),
            "dtype": dtype_name(plan.cfg.dtype), "device": plan.spec.device,
            "tokens_per_dp_rank": ",".join(map(str, plan.tokens_per_rank))}


# -- bounds, before anything starts --------------------------------------------------------------
def files_read(spec: RunSpec) -> list[Path]:
    """Every file the run reads: the input, and the checkpoint's config, index and safetensors
    files (an output path must be none of them)."""
    files = [Path(spec.input_path)] if spec.input_path is not None else []
    if spec.model_dir is not None:
        model_dir = Path(spec.model_dir)
        files += [model_dir / "config.json", model_dir / INDEX_FILE]
        if model_dir.is_dir():
            files += sorted(model_dir.glob("*.safetensors"))
    return files


def estimate_memory(plan: RunPlan) -> dict[str, int]:
    """Bytes the run will hold at its peak, by part, for all local ranks and the parent together
    (an estimate from the shapes; the live ranks' interpreters are ``capacity.RANK_MEMORY_BYTES``
    each on top). Each rank holds its weights (random weights: every rank makes all of them,
    in fp32 first), its DP rank's tokens and their routed copies; rank 0 and the parent hold the
    output of all T tokens (and the parent a generated input)."""
    cfg, p = plan.cfg, plan.parallel
    E, H, I, K, S = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size, cfg.top_k, cfg.shared_width
    elt = torch.empty(0, dtype=cfg.dtype).element_size()
    expert = 3 * I * H
    if plan.spec.model_dir is None:
        weights = E * expert * (elt + 4) + (E * H + 3 * S * H) * (elt + 4)
    else:
        local = E // p.ep_size
        weights = local * expert // (1 if p.enable_ep else p.tp) * elt + expert * 4 + (E * H + 3 * S * H) * elt
    T, widest = plan.total_tokens, max(plan.tokens_per_rank)
    width = I if p.enable_ep else I // p.tp
    tokens = widest * H * (4 + elt) + widest * K * (2 * width + 2 * H) * 4 + widest * H * 4
    output = T * H * elt
    parent = 2 * output + (T * H * (4 + elt) if plan.generated_input else 0)
    ranks = p.world_size
    return {"weights": ranks * weights, "tokens": ranks * tokens, "output": output + parent}


def check_memory(plan: RunPlan, available: int | None) -> None:
    """Refuses (ValueError) a run whose ``estimate_memory`` exceeds ``available`` bytes."""
    if available is None:
        return
    parts = estimate_memory(plan)
    need = sum(parts.values())
    if need > available:
        detail = ", ".join(f"{name} {value / 2**30:.2f}" for name, value in parts.items())
        raise ValueError(f"this run needs about {need / 2**30:.1f} GiB of memory ({detail} GiB, over "
                         f"{plan.parallel.world_size} rank(s) and the parent) but {available / 2**30:.1f} GiB is "
                         f"available; use fewer tokens (--tokens / --input), fewer ranks or a smaller model")
