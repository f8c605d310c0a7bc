"""What ``moeshard generate`` does: plan once (no processes yet), then greedy generation of a whole
transformers model on every rank, then (on request) the same generation by transformers alone.

    plan_generate(GenerateSpec)      parent, before any process starts: reads config.json, checks
                                     the prompts (ids in the vocabulary), the layout against the
                                     model (expert count, intermediate size, quantization, backend),
                                     splits the prompts over the DP ranks; refuses with a ValueError
    generate_rank(plan, groups)      every rank: ``load_sharded_model`` (its slices only; all ranks
                                     agree that loading worked before the first collective), then
                                     greedy generation of its DP rank's prompts -> GenerateRankResult
    generate_plans(plans)            ``spawn`` entry: several plans on one set of ranks
    reference_generate(plan)         transformers alone (``from_pretrained``, every expert), each DP
                                     rank's prompts as the same batch -> ids and per-step logits
    compare_generations(...)         ids and per-step logits, moeshard against transformers

Prompts and ranks: prompt ``i`` goes to DP rank ``d`` by a contiguous split (the first
``P % dp`` DP ranks get one more, like ``moeshard run``'s tokens); the TP ranks of a DP rank run
the same prompts as one batch, left-padded to the longest with an attention mask. Every prompt
gets exactly ``max_new_tokens`` tokens: EOS does not stop generation, because under EP every
rank must run the same number of forward passes (each MoE block is a collective over all
ranks) and a fixed count makes the comparison cover every step. With tp > 1, TP rank 0's
logits are broadcast over the TP group at each step so all TP ranks pick the same token; a step
where they differed is counted (``tp_disagreements``) and reported, never hidden.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from moeshard.checkpoint.hf_config import read_hf_config, text_model_config
from moeshard.checkpoint.hf_model import load_transformers_model, transformers_refusal
from moeshard.checkpoint.loader import resolve_quant
from moeshard.config import MoEConfig, QuantConfig, dtype_name, parse_dtype
from moeshard.jobs.world import RankPlace, each_plan, load_timed, synchronize
from moeshard.parallel.config import ParallelConfig
from moeshard.parallel.groups import ParallelGroups
from moeshard.tolerances import logits_tolerance, within
from moeshard.validate import is_int

# The options prompts come from, named in the refusals of what they hold.
PROMPT_SOURCES = ("--input-ids", "--input-file")


@dataclass(frozen=True)
class GenerateSpec:
    """What the user asked for. prompts: token ids, one tuple per prompt; quant/dtype/backend
    None: the checkpoint's quantization and dtype, the layout's default backend; compare: keep
    each step's logits so they can be compared with transformers alone; prompts_from: the
    command-line option the prompts came from (``PROMPT_SOURCES``), which refusals name."""

    model_dir: str
    prompts: tuple[tuple[int, ...], ...]
    max_new_tokens: int = 16
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    quant: str | None = None
    defer_input_quant: bool = False
    shared_quant: str = "none"
    dtype: str | None = None
    backend: str | None = None
    device: str = "cpu"
    compare: bool = False
    prompts_from: str = "--input-ids"

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"generate: device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.prompts_from not in PROMPT_SOURCES:
            raise ValueError(f"generate: prompts_from must be one of {list(PROMPT_SOURCES)}, got {self.prompts_from!r}")
        if not is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens: must be an integer >= 1, got {self.max_new_tokens!r}")
        if not self.prompts:
            raise ValueError(f"{self.prompts_from}: no prompt given")
        for i, prompt in enumerate(self.prompts):
            if not prompt:
                raise ValueError(f"{self.prompts_from}: prompt {i} is empty")
            if any(not is_int(t) or t < 0 for t in prompt):
                raise ValueError(f"{self.prompts_from}: prompt {i} holds {list(prompt)[:8]}; token ids are integers >= 0")


@dataclass(frozen=True)
class GeneratePlan:
    """A checked, resolved run; every rank executes the same plan. dp_prompts[d]: indices of the
    prompts DP rank d runs; pad_token_id: what left padding is filled with (masked out)."""

    spec: GenerateSpec
    model_type: str
    cfg: MoEConfig
    quant: QuantConfig
    backend: str
    vocab_size: int
    pad_token_id: int
    dp_prompts: tuple[tuple[int, ...], ...]

    @property
    def parallel(self) -> ParallelConfig:
        return self.spec.parallel

    @property
    def dtype(self) -> torch.dtype:
        return self.cfg.dtype

    @property
    def max_tokens_per_rank(self) -> int:
        """The most rows one MoE forward of any rank may see: a DP rank's prompts, left-padded to
        its longest, times that length plus every new token (an upper bound of the prefill and
        of any later step, cache or not). Backends with fixed per-rank buffers are sized by it."""
        return max(len(mine) * (max(len(self.spec.prompts[i]) for i in mine) + self.spec.max_new_tokens)
                   for mine in self.dp_prompts)


@dataclass(frozen=True)
class GenerateRankResult:
    """One rank's report. prompts: the prompt indices it ran (its DP rank's); generated: the new
    ids of each, ``max_new_tokens`` long; logits: fp32 [steps, len(prompts), vocab] when
    ``spec.compare`` (else None); experts: [start, stop) of the experts it holds, intermediate:
    its [lo, hi) of I; expert_bytes: bytes of routed-expert tensors it holds; tp_disagreements:
    steps at which its logits differed from its TP rank 0's; nonfinite: (step, prompt index)
    of every step whose logits (those greedy chose from) held NaN/Inf (``_finite_scores``)."""

    rank: int
    dp_rank: int
    tp_rank: int
    prompts: tuple[int, ...]
    generated: tuple[tuple[int, ...], ...]
    logits: torch.Tensor | None
    experts: tuple[int, int]
    intermediate: tuple[int, int]
    expert_bytes: int
    load_s: float
    generate_s: float
    tp_disagreements: int
    nonfinite: tuple[tuple[int, int], ...] = ()


def split_prompts(count: int, dp: int) -> tuple[tuple[int, ...], ...]:
    """Prompt indices per DP rank: contiguous, the first ``count % dp`` ranks get one more."""
    out, start = [], 0
    for d in range(dp):
        n = count // dp + (1 if d < count % dp else 0)
        out.append(tuple(range(start, start + n)))
        start += n
    return tuple(out)


def check_prompts(model_dir: str, prompts: tuple[tuple[int, ...], ...], dp: int,
                  flag: str = "--input-ids") -> tuple[dict, int, int]:
    """(config.json as read, vocab_size, the padding id) of ``model_dir``, after refusing a token
    id outside the vocabulary and fewer prompts than DP ranks (each DP rank runs its own). The
    padding id is the config's ``pad_token_id`` when it is a token of the vocabulary, else 0 (it
    only fills masked positions)."""
    info = read_hf_config(model_dir)
    raw, _ = text_model_config(json.loads((Path(model_dir) / "config.json").read_text()), info.source)
    vocab = raw.get("vocab_size")
    if not is_int(vocab) or vocab < 1:
        raise ValueError(f"{info.source}: vocab_size must be a positive integer, got {vocab!r}")
    for i, prompt in enumerate(prompts):
        bad = [t for t in prompt if t >= vocab]
        if bad:
            raise ValueError(f"{flag}: prompt {i} holds token ids {bad[:8]} outside the vocabulary "
                             f"[0, {vocab}) of {model_dir}")
    if len(prompts) < dp:
        raise ValueError(f"--dp {dp}: every DP rank runs its own prompts, but only {len(prompts)} prompt(s) "
                         f"were given; give at least {dp} (prompts are separated by ';')")
    pad = raw.get("pad_token_id")
    return raw, vocab, pad if is_int(pad) and 0 <= pad < vocab else 0


def plan_generate(spec: GenerateSpec) -> GeneratePlan:
    """Checks everything that can be checked before processes start; returns the plan."""
    from moeshard.integrations.transformers import check_layout

    p = spec.parallel
    info = read_hf_config(spec.model_dir)
    raw, vocab, pad = check_prompts(spec.model_dir, spec.prompts, p.dp, spec.prompts_from)
    positions = raw.get("max_position_embeddings")
    longest = max(len(prompt) for prompt in spec.prompts)
    if is_int(positions) and longest + spec.max_new_tokens > positions:
        raise ValueError(f"--max-new-tokens {spec.max_new_tokens}: the longest prompt has {longest} tokens, and "
                         f"{longest} + {spec.max_new_tokens} is more than the model's max_position_embeddings="
                         f"{positions}; give at most {max(positions - longest, 0)}")
    quant = resolve_quant(info, spec.quant)
    quant = QuantConfig(quant.scheme, defer_input_quant=spec.defer_input_quant, shared=spec.shared_quant)
    dtype = parse_dtype(spec.dtype) if spec.dtype is not None else (info.checkpoint_dtype or torch.float32)
    cfg = info.moe_config(dtype)
    backend = check_layout(cfg, quant, p, spec.backend, spec.device)
    refusal = transformers_refusal(spec.model_dir) if spec.compare else None
    if refusal:
        raise ValueError(refusal)
    return GeneratePlan(spec=spec, model_type=info.model_type, cfg=cfg, quant=quant, backend=backend,
                        vocab_size=vocab, pad_token_id=pad, dp_prompts=split_prompts(len(spec.prompts), p.dp))


# -- generation (on a rank, or transformers alone) ---------------------------------------------
def padded_batch(prompts: list[tuple[int, ...]], pad: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded input_ids [B, L] and attention_mask [B, L] (1 on real tokens)."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
        mask[row, width - len(prompt):] = 1
    return ids.to(device), mask.to(device)


def _same_on_tp_ranks(groups: ParallelGroups):
    """A transformers LogitsProcessor: TP rank 0's scores are broadcast over the TP group (all TP
    ranks then pick the same token); counts the steps at which this rank's scores differed."""
    from transformers import LogitsProcessor

    class SameOnTPRanks(LogitsProcessor):
        def __init__(self) -> None:
            self.disagreements = 0

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            agreed = scores.clone()
            dist.broadcast(agreed, src=groups.tp_ranks[0], group=groups.tp_group)
            if not torch.equal(agreed, scores):
                self.disagreements += 1
            return agreed

    return SameOnTPRanks()


def _finite_scores(prompts: tuple[int, ...]):
    """A transformers LogitsProcessor that records, at each step, the prompts (by index) whose
    scores hold NaN or +Inf, or no finite value at all: greedy's choice among those means
    nothing. -Inf alone is not counted: it is how a processor rules a token out."""
    from transformers import LogitsProcessor

    class FiniteScores(LogitsProcessor):
        def __init__(self) -> None:
            self.step = 0
            self.bad: list[tuple[int, int]] = []

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            broken = torch.isnan(scores).any(-1) | torch.isposinf(scores).any(-1) | ~torch.isfinite(scores).any(-1)
            self.bad += [(self.step, prompts[row]) for row in broken.nonzero().flatten().tolist()]
            self.step += 1
            return scores

    return FiniteScores()


def greedy(model, prompts: list[tuple[int, ...]], max_new_tokens: int, pad_token_id: int, keep_logits: bool,
           processors: list | None = None) -> tuple[list[tuple[int, ...]], torch.Tensor | None]:
    """Greedy generation of exactly ``max_new_tokens`` tokens for each prompt, as one left-padded
    batch (EOS does not stop it) -> (new ids per prompt, fp32 logits [steps, B, V] or None)."""
    import copy

    from transformers import LogitsProcessorList

    device = next(model.parameters()).device
    ids, mask = padded_batch(prompts, pad_token_id, device)
    config = copy.deepcopy(model.generation_config)
    config.eos_token_id = None  # exactly max_new_tokens steps on every rank
    config.pad_token_id = pad_token_id
    config.do_sample = False
    for name in ("temperature", "top_p", "top_k"):  # sampling settings a checkpoint may carry
        setattr(config, name, None)
    config.max_new_tokens = max_new_tokens
    config.output_logits = keep_logits
    config.return_dict_in_generate = True
    # generate() fills what the given config leaves None from model.generation_config, EOS
    # included: the model's own is cleared for the call, then restored. A config with
    # output_router_logits on makes transformers' MoE models compute their training auxiliary
    # loss at every step, which fails with a KV cache and a batch of several prompts ("size of
    # tensor a (2) must match ... (8)", transformers' own generate too) and plays no part in
    # generation: it is off for the call, then restored.
    saved = model.generation_config.eos_token_id
    router_logits = getattr(model.config, "output_router_logits", None)
    model.generation_config.eos_token_id = None
    if router_logits:
        model.config.output_router_logits = False
    try:
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, generation_config=config,
                                 logits_processor=LogitsProcessorList(processors or []))
    finally:
        model.generation_config.eos_token_id = saved
        if router_logits:
            model.config.output_router_logits = router_logits
    new = out.sequences[:, ids.shape[1]:].cpu()
    if new.shape[1] != max_new_tokens:
        raise RuntimeError(f"generate returned {new.shape[1]} new tokens, expected {max_new_tokens}")
    logits = torch.stack([s.float().cpu() for s in out.logits]) if keep_logits else None
    return [tuple(row.tolist()) for row in new], logits


def generate_rank(plan: GeneratePlan, groups: ParallelGroups | None) -> GenerateRankResult:
    """Runs ``plan`` on this rank (groups None: the single-rank layout, no process group)."""
    from moeshard.integrations.transformers import expert_bytes
    from moeshard.layer import MoELayer

    p, spec = plan.parallel, plan.spec
    place = RankPlace.of(plan, groups)
    rank, dp_rank, tp_rank, device = place.rank, place.dp_rank, place.tp_rank, place.device
    model, load_s = load_timed(plan, groups, device)
    block = next(m for m in model.modules() if isinstance(m, MoELayer))
    same = None
    if p.tp > 1:
        assert groups is not None  # tp > 1: a world of several ranks, which runs with its groups
        same = _same_on_tp_ranks(groups)
    mine = plan.dp_prompts[dp_rank]
    finite = _finite_scores(mine)  # last: it sees the scores greedy chooses from (TP rank 0's, with tp > 1)
    processors = [same, finite] if same is not None else [finite]
    if groups is not None:
        dist.barrier()
    t1 = time.perf_counter()
    generated, logits = greedy(model, [spec.prompts[i] for i in mine], spec.max_new_tokens, plan.pad_token_id,
                               spec.compare, processors)
    synchronize(device)
    generate_s = time.perf_counter() - t1
    s = block.shard
    width = plan.cfg.intermediate_size // s.tp_size
    return GenerateRankResult(rank=rank, dp_rank=dp_rank, tp_rank=tp_rank, prompts=mine, generated=tuple(generated),
                              logits=logits, experts=(s.expert_start, s.expert_stop),
                              intermediate=(s.tp_rank * width, (s.tp_rank + 1) * width),
                              expert_bytes=expert_bytes(model), load_s=load_s, generate_s=generate_s,
                              tp_disagreements=same.disagreements if same is not None else 0,
                              nonfinite=tuple(finite.bad))


def generate_plans(plans: list[GeneratePlan]) -> list[GenerateRankResult | dict]:
    """``spawn`` entry: every plan in order on this rank (all plans need this world size). A plan
    that raises is recorded as ``{"error": type name, "message": ...}`` and the next plan runs;
    groups are built once per layout and reused. On CPU the machine's cores are shared out
    between the local ranks (as torchrun's OMP_NUM_THREADS=1 does): torch's default of every
    core per rank oversubscribes them, and its spinning threads made generation ~8x slower."""
    if plans and plans[0].spec.device == "cpu" and dist.is_initialized():
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // dist.get_world_size()))
    return each_plan(plans, generate_rank)


Generation = tuple[list[tuple[int, ...]], torch.Tensor]  # (new ids per prompt, fp32 logits [steps, B, V])


def reference_generate(plan: GeneratePlan, device: str | torch.device | None = None,
                       dtype: torch.dtype | None = None) -> list[Generation]:
    """transformers alone (``from_pretrained``, every expert, no moeshard), in ``dtype`` (default
    the plan's): per DP rank, its prompts as the same batch -> [(new ids per prompt, logits)]."""
    device = torch.device(device if device is not None else ("cuda" if plan.spec.device == "cuda" else "cpu"))
    model = load_transformers_model(plan.spec.model_dir, dtype or plan.dtype)
    model = model.to(device).eval()
    spec = plan.spec
    out: list[Generation] = []
    for mine in plan.dp_prompts:
        ids, logits = greedy(model, [spec.prompts[i] for i in mine], spec.max_new_tokens, plan.pad_token_id, True)
        assert logits is not None  # keep_logits=True
        out.append((ids, logits))
    return out


def nonfinite_logits(results: list[GenerateRankResult]) -> list[tuple[int, int]]:
    """(prompt index, step) of every step whose logits held NaN/Inf, in order (TP rank 0's)."""
    return sorted({(i, step) for r in results if r.tp_rank == 0 for step, i in r.nonfinite})


def by_prompt(plan: GeneratePlan, results: list[GenerateRankResult]) -> list[tuple[int, ...]]:
    """The new ids of every prompt, in prompt order (from each DP rank's TP rank 0)."""
    out: list[tuple[int, ...] | None] = [None] * len(plan.spec.prompts)
    for r in results:
        if r.tp_rank == 0:
            for i, ids in zip(r.prompts, r.generated, strict=True):
                out[i] = ids
    missing = [i for i, ids in enumerate(out) if ids is None]
    if missing:
        raise RuntimeError(f"no rank reported prompts {missing}")
    return [ids for ids in out if ids is not None]


@dataclass(frozen=True)
class GenerateComparison:
    """moeshard against transformers alone, on the same prompts and batches.

    same_ids[i]: prompt i's new ids are identical; first_difference[i]: the first step whose id
    differs (None if none). step_max_abs[s]: max |logits - transformers' logits| over every
    prompt still on the same context at step s (every prompt up to and including its first
    differing step; after it the contexts differ), None once no prompt is; within_tolerance:
    every compared logit within ``moeshard.tolerances.LOGITS`` for the model dtype (atol, rtol); None
    for a quantized run, whose difference is the quantization error against the unquantized
    model (reported, not judged by the tolerance table, which bounds parallel error).
    dtype_noise[s] (when a more precise reference was given: float32 for bf16 / fp16 runs,
    float64 for float32 runs): the same measure for transformers' own model-dtype logits against
    those, i.e. how far rounding in the model dtype alone moves this model's logits.
    within_noise (float32 runs measured against float64): every step within the table, or its
    difference at most twice transformers' own float32 rounding, the largest over the compared
    steps (two float32 computations of the same logits, each as far from the exact ones as
    transformers' is, can differ by that much; the largest, because a rounding difference stays in
    the context of every later step and one step's distance is one sample of it); None when not
    measured."""

    same_ids: tuple[bool, ...]
    first_difference: tuple[int | None, ...]
    step_max_abs: tuple[float | None, ...]
    atol: float
    rtol: float
    within_tolerance: bool | None
    quant: str = "none"
    dtype_noise: tuple[float | None, ...] | None = None
    noise_dtype: str | None = None
    within_noise: bool | None = None

    @property
    def max_abs(self) -> float:
        return max((v for v in self.step_max_abs if v is not None), default=0.0)

    def to_json(self) -> dict:
        noise = None if self.dtype_noise is None else list(self.dtype_noise)
        return {"same_ids": list(self.same_ids), "first_difference": list(self.first_difference),
                "step_max_abs_logit_diff": list(self.step_max_abs), "max_abs_logit_diff": self.max_abs,
                "tolerance": {"atol": self.atol, "rtol": self.rtol}, "within_tolerance": self.within_tolerance,
                "quant": self.quant, "transformers_rounding_step_max_abs": noise,
                "noise_reference_dtype": self.noise_dtype, "within_rounding_noise": self.within_noise}


def _prompt_diffs(ids, logits, ref_ids, ref_logits, dtype: torch.dtype):
    """One prompt: (first differing step or None, [(max abs error, within the table)] for each
    step on the same context, i.e. up to and including the first differing one)."""
    steps = len(ref_ids)
    diff = [s for s in range(steps) if ids[s] != ref_ids[s]]
    last = diff[0] if diff else steps - 1
    atol, rtol = logits_tolerance(dtype)
    errs = []
    for s in range(last + 1):
        c = within(logits[s], ref_logits[s], atol, rtol)
        errs.append((c.max_abs_err, c.ok))
    return (diff[0] if diff else None), errs


def _fold(step_max: list[float | None], errs) -> None:
    for s, (err, _) in enumerate(errs):
        step_max[s] = err if step_max[s] is None else max(step_max[s], err)


def compare_generations(plan: GeneratePlan, results: list[GenerateRankResult], reference: list[Generation],
                        fp32_reference: list[Generation] | None = None) -> GenerateComparison:
    """Compares every DP rank's TP rank 0 with ``reference`` (``reference_generate(plan)``) of the
    same batch; with ``fp32_reference`` (``reference_generate(plan, dtype=D)``, D float32 for a
    bf16 / fp16 plan, float64 for a float32 one) also measures transformers' own rounding in the
    model dtype (``dtype_noise``) and, for a float32 plan, judges against it (``within_noise``)."""
    steps, count = plan.spec.max_new_tokens, len(plan.spec.prompts)
    same, first = [False] * count, [None] * count
    step_max: list[float | None] = [None] * steps
    step_ok = [True] * steps
    noise: list[float | None] | None = [None] * steps if fp32_reference is not None else None
    ok = True
    for r in results:
        if r.tp_rank != 0:
            continue
        if r.logits is None:
            raise ValueError("compare_generations: the ranks kept no logits (GenerateSpec.compare was False)")
        ref_ids, ref_logits = reference[r.dp_rank]
        for row, i in enumerate(r.prompts):
            first[i], errs = _prompt_diffs(r.generated[row], r.logits[:, row], ref_ids[row], ref_logits[:, row],
                                           plan.dtype)
            same[i] = first[i] is None
            ok = ok and all(good for _, good in errs)
            for step, (_, good) in enumerate(errs):
                step_ok[step] = step_ok[step] and good
            _fold(step_max, errs)
            if noise is not None and fp32_reference is not None:  # noise is kept exactly when fp32_reference is given
                f32_ids, f32_logits = fp32_reference[r.dp_rank]
                _fold(noise, _prompt_diffs(ref_ids[row], ref_logits[:, row], f32_ids[row], f32_logits[:, row],
                                           plan.dtype)[1])
    atol, rtol = logits_tolerance(plan.dtype)
    noise_dtype = within_noise = None
    if noise is not None:
        noise_dtype = "float64" if plan.dtype == torch.float32 else "float32"
        if noise_dtype == "float64" and not plan.quant.quantized:
            scale = max((n for n in noise if n is not None), default=0.0)
            within_noise = all(good or (err is not None and err <= 2 * scale)
                               for good, err in zip(step_ok, step_max, strict=True))
    return GenerateComparison(same_ids=tuple(same), first_difference=tuple(first), step_max_abs=tuple(step_max),
                              atol=atol, rtol=rtol, within_tolerance=None if plan.quant.quantized else ok,
                              quant=plan.quant.name, dtype_noise=None if noise is None else tuple(noise),
                              noise_dtype=noise_dtype, within_noise=within_noise)


def describe(plan: GeneratePlan) -> dict:
    """The plan as JSON-able fields (for the summary and ``--output``)."""
    spec = plan.spec
    return {"model": spec.model_dir, "model_type": plan.model_type, "layout": plan.parallel.name,
            "world_size": plan.parallel.world_size, "device": spec.device, "backend": plan.backend,
            "quant": plan.quant.name, "dtype": dtype_name(plan.dtype), "max_new_tokens": spec.max_new_tokens,
            "prompts_per_dp_rank": [list(d) for d in plan.dp_prompts]}
