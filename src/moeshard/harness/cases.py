"""The verification matrix: layouts x backends x quants x dtypes x shapes x token counts.

Every combination the support registry or the sharding rules refuse is kept as a skipped case
with the refusal's reason, so a run says exactly what it did not run and why.
"""

from __future__ import annotations

import itertools
import zlib
from dataclasses import dataclass, field, replace

from moeshard.autograd.support import backward_refusal
from moeshard.config import MoEConfig, QuantConfig, dtype_name, parse_dtype
from moeshard.dispatch.registry import BACKENDS, support
from moeshard.eplb.placement import Layout
from moeshard.parallel.config import ParallelConfig
from moeshard.presets import PRESETS, SIZES
from moeshard.quant import scheme_names
from moeshard.sharding import ShardSpec

# (dp, tp, enable_ep) per world size; with EP on and tp > 1 the layout is sequence parallel.
LAYOUTS: dict[int, list[tuple[int, int, bool]]] = {
    1: [(1, 1, False)],
    2: [(1, 2, False), (2, 1, True), (2, 1, False), (1, 2, True)],
    4: [(1, 4, False), (4, 1, True), (2, 2, True), (2, 2, False), (1, 4, True)],
    8: [(2, 4, True), (4, 2, True), (8, 1, True), (2, 4, False)],
}

# Tokens per DP rank: empty ranks, one token, fewer tokens than TP ranks, odd counts, uneven ranks.
TOKEN_PATTERNS: dict[int, list[tuple[int, ...]]] = {
    1: [(7,), (1,), (0,), (64,), (3,), (5,)],
    2: [(0, 5), (1, 0), (3, 64), (7, 1), (1, 1), (5, 2)],
    4: [(1, 0, 3, 2), (0, 0, 0, 1), (7, 64, 0, 1), (2, 5, 1, 3)],
    8: [(1, 0, 3, 2, 0, 5, 7, 1), (3, 3, 3, 3, 3, 3, 3, 3), (0, 64, 1, 0, 2, 9, 0, 4)],
}


# The most tokens one DP rank may be given with --tokens-per-rank: the fp64 reference of every
# case runs on the CPU, and beyond this a case would take minutes (the default patterns stay <= 64).
MAX_TOKENS_PER_RANK = 1 << 16


# Quantized shared experts (``QuantConfig.shared``): DeepSeek-V3's fp8 checkpoints' kind (the
# routed and shared experts in 128-block fp8), and per-row shared experts beside per-tensor
# routed ones.
SHARED_QUANTS = (("fp8_block", "fp8_block"), ("fp8_tensor", "fp8_token"))


def quant_configs() -> list[QuantConfig]:
    """Every registered scheme, then every quantized one with deferred input quantization, then
    the quantized shared experts of ``SHARED_QUANTS``."""
    names = scheme_names()
    return ([QuantConfig(s) for s in names] + [QuantConfig(s, True) for s in names if s != "none"]
            + [QuantConfig(routed, shared=shared) for routed, shared in SHARED_QUANTS])


def presets_for(quant: QuantConfig, presets: list[str], size: str) -> list[str]:
    """The presets a quant's cases rotate over: those with shared experts for quantized shared
    experts (the others cannot run them), else all."""
    if quant.shared == "none":
        return presets
    return [name for name in presets if PRESETS[name].config(size).has_shared_experts] or presets

DTYPES = ("float32", "bfloat16")

# Expert-parallel load balancing cases: redundant slots per rank, skewed routing, the policy of
# the rebalance in the middle of the case.
EPLB_REDUNDANT = (0, 1, 2)
EPLB_SKEWS = ("one", "zipf")
EPLB_POLICIES = ("hierarchical", "greedy")
EPLB_MODES = ("off", "default", "full")
# The few EPLB cases of the default matrix: every EP backend, a layout with and one without SP,
# per-tensor scales (fp8_tensor, nvfp4: replicas must share h's amax) with replicas, both skews.
DEFAULT_EPLB = (
    ("dp2-tp1-ep", "all2all", "fp8_tensor", "float32", 1, "zipf", "hierarchical"),
    ("dp2-tp1-ep", "low_latency", "nvfp4", "bfloat16", 2, "one", "greedy"),
    ("dp2-tp1-ep", "allgather_reducescatter", "none", "float32", 0, "zipf", "hierarchical"),
    ("dp2-tp2-ep", "all2all", "fp8_block", "bfloat16", 1, "one", "hierarchical"),
    ("dp2-tp2-ep", "low_latency", "fp8_tensor+defer", "float32", 2, "zipf", "greedy"),
)


@dataclass(frozen=True)
class EPLBCase:
    """The load-balancing part of a case: ``redundant_per_rank`` extra slots per EP rank, routing
    skewed by ``skew`` (``moeshard.harness.inputs.SKEWS``), rebalanced mid-case by ``policy``."""

    redundant_per_rank: int
    skew: str
    policy: str

    @property
    def name(self) -> str:
        return f"eplb-r{self.redundant_per_rank}-{self.skew}-{self.policy}"


@dataclass(frozen=True)
class Case:
    """One verification case. ``tokens``: tokens per DP rank; ``seed``: of its tokens (from the id
    alone); ``weight_seed``: of its weights, the same for every case of one model shape and dtype
    (``weight_seed_of``), so that cases share weights and their quantized forms; ``reason``: why
    it is skipped; ``grad``: a gradient case (``moeshard.harness.grads``; its id ends ``/grad``)."""

    parallel: ParallelConfig
    backend: str
    quant: QuantConfig
    dtype: str
    preset: str
    size: str
    tokens: tuple[int, ...]
    seed: int
    reason: str = ""
    id: str = field(default="", compare=False)
    weight_seed: int = 0
    eplb: EPLBCase | None = None
    grad: bool = False

    def __post_init__(self) -> None:
        if not self.id:
            q = self.quant.name
            size = "" if self.size == "small" else f"@{self.size}"
            toks = ",".join(map(str, self.tokens))
            eplb = "" if self.eplb is None else f"/{self.eplb.name}"
            grad = "/grad" if self.grad else ""
            object.__setattr__(self, "id", f"{self.parallel.name}/{self.backend}/{q}/{self.dtype}/"
                                           f"{self.preset}{size}/t{toks}{eplb}{grad}")

    @property
    def skew(self) -> str:
        """The routing skew of the case's inputs ("" for the random router)."""
        return "" if self.eplb is None else self.eplb.skew

    @property
    def world_size(self) -> int:
        return self.parallel.world_size

    @property
    def skipped(self) -> bool:
        return bool(self.reason)

    def moe_config(self) -> MoEConfig:
        return PRESETS[self.preset].config(self.size, parse_dtype(self.dtype))

    def memory_bytes(self) -> int:
        """About the most memory the case holds on all its ranks together: each rank makes the
        full weights (fp32, then the model dtype), and the fp64 reference holds the dequantized
        weights, with the tokens and their routed rows beside them."""
        cfg = self.moe_config()
        E, H, I, K = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size, cfg.top_k
        weights = (E * 3 * I * H + E * H + 3 * cfg.shared_width * H) * (4 + 8)
        T = sum(self.tokens)
        tokens = T * K * (2 * I + 2 * H) * 8 + T * H * 16
        return self.world_size * (weights + tokens)

    @property
    def weights_key(self) -> tuple[str, str, str, int, str]:
        """What the case's weights depend on: cases with equal keys have identical weights."""
        return self.preset, self.size, self.dtype, self.weight_seed, self.skew


def weight_seed_of(preset: str, size: str, dtype: str, run_seed: int = 0) -> int:
    """The weights' seed of every case of one model shape and dtype (``--seed`` shifts it)."""
    return (zlib.crc32(f"{preset}@{size}/{dtype}".encode()) + run_seed * 7919) % 2**31


def refusal(parallel: ParallelConfig, backend: str, quant: QuantConfig, cfg: MoEConfig,
            eplb: EPLBCase | None = None) -> str:
    """The reason this combination cannot run, or "" when it can (same checks as the layer)."""
    ok, reason = support(backend, quant, parallel)
    if not ok:
        return reason
    try:
        quant.check_model(cfg, "quant")
        parallel.validate(parallel.world_size, cfg)
        E, ep, tp = cfg.num_experts, parallel.ep_size, parallel.tp
        spec = ShardSpec(0, E // ep, 0, 1) if parallel.enable_ep else ShardSpec(0, E, 0, tp)
        spec.validate(cfg, quant)
        if eplb is not None:
            if not parallel.enable_ep:
                return f"load balancing needs expert parallelism; layout {parallel.name} has EP off"
            Layout(E, ep, eplb.redundant_per_rank)
    except ValueError as exc:
        return str(exc)
    return ""


@dataclass(frozen=True)
class MatrixOptions:
    """Filters and axes of the matrix (None = the defaults); backward: add the gradient cases."""

    world_sizes: tuple[int, ...] = (1, 2, 4)
    layouts: tuple[ParallelConfig, ...] | None = None
    backends: tuple[str, ...] | None = None
    quants: tuple[str, ...] | None = None
    dtypes: tuple[str, ...] = DTYPES
    presets: tuple[str, ...] | None = None
    size: str = "small"
    tokens_per_rank: tuple[int, ...] | None = None
    all_presets: bool = False
    seed: int = 0
    eplb: str = "default"
    backward: bool = False

    def __post_init__(self) -> None:
        if self.eplb not in EPLB_MODES:
            raise ValueError(f"eplb: {self.eplb!r} is not one of {list(EPLB_MODES)}")
        for p in self.layouts or ():
            if p.world_size not in LAYOUTS:
                raise ValueError(f"--layouts: {p.name} has world size {p.world_size}; moeshard check runs world "
                                 f"sizes {sorted(LAYOUTS)}")
        for w in self.world_sizes:
            if w not in LAYOUTS:
                raise ValueError(f"--world-sizes: {w} is not one of {sorted(LAYOUTS)}")
        for p in self.layouts or ():
            if p.world_size not in self.world_sizes:
                raise ValueError(f"--layouts: {p.name} has world size {p.world_size}, which --world-sizes "
                                 f"{','.join(map(str, self.world_sizes))} leaves out")
        for b in self.backends or ():
            if b not in BACKENDS:
                raise ValueError(f"--backends: {b!r} is not one of {sorted(BACKENDS)}")
        known = {q.name for q in quant_configs()}
        for q in self.quants or ():
            if q not in known:
                raise ValueError(f"--quants: {q!r} is not one of {sorted(known)}")
        try:
            # Spelled as case ids spell them (fp32 -> float32), once each: every id --list prints
            # is one --only takes, and fp32,float32 is one dtype, not two runs of it.
            names = tuple(dict.fromkeys(dtype_name(parse_dtype(d)) for d in self.dtypes))
        except ValueError as exc:
            raise ValueError(f"--dtypes: {exc}") from None
        object.__setattr__(self, "dtypes", names)
        for preset in self.presets or ():
            if preset not in PRESETS:
                raise ValueError(f"--presets: {preset!r} is not one of {sorted(PRESETS)}")
        if self.tokens_per_rank is not None and any(not 0 <= t <= MAX_TOKENS_PER_RANK for t in self.tokens_per_rank):
            raise ValueError(f"--tokens-per-rank: counts must be in [0, {MAX_TOKENS_PER_RANK}], "
                             f"got {list(self.tokens_per_rank)}")


def generate(opts: MatrixOptions) -> list[Case]:
    """All cases of the matrix, skipped ones included, in a stable order.

    Each (layout, backend, quant, dtype) combination gets one case whose model preset and token
    counts rotate through the presets and token patterns, so the default matrix touches every
    axis value in every layout without multiplying them all; ``all_presets`` runs every preset.
    ``tokens_per_rank`` pins the token counts (cases whose DP size differs are left out).
    """
    presets = list(opts.presets or PRESETS)
    layouts = []
    for w in opts.world_sizes:
        for dp, tp, ep in LAYOUTS[w]:
            p = ParallelConfig(dp, tp, ep)
            if opts.layouts is None or p in opts.layouts:
                layouts.append(p)
    for p in opts.layouts or ():
        if p not in layouts:
            layouts.append(p)
    cases: list[Case] = []
    rotation = itertools.count()
    # The quantized shared experts rotate over their own count, so that adding them left every
    # other case (its preset and tokens) as it was.
    shared_rotation = itertools.count()
    for p in layouts:
        if opts.tokens_per_rank is not None and len(opts.tokens_per_rank) != p.dp:
            continue
        patterns = [opts.tokens_per_rank] if opts.tokens_per_rank is not None else TOKEN_PATTERNS[p.dp]
        for backend in BACKENDS:
            if opts.backends is not None and backend not in opts.backends:
                continue
            for q in quant_configs():
                if opts.quants is not None and q.name not in opts.quants:
                    continue
                usable = presets_for(q, presets, opts.size)
                for dtype in opts.dtypes:
                    n = next(rotation if q.shared == "none" else shared_rotation)
                    chosen = usable if opts.all_presets else [usable[n % len(usable)]]
                    for k, preset in enumerate(chosen):
                        tokens = patterns[(n + k) % len(patterns)]
                        cfg = PRESETS[preset].config(opts.size, parse_dtype(dtype))
                        reason = refusal(p, backend, q, cfg)
                        case = Case(p, backend, q, dtype, preset, opts.size, tuple(tokens), 0, reason,
                                    weight_seed=weight_seed_of(preset, opts.size, dtype, opts.seed))
                        # The seeds depend on the id alone, so `--only ID` reproduces a case exactly.
                        cases.append(replace(case, seed=_case_seed(case.id, opts.seed)))
    if opts.eplb != "off":
        cases += eplb_cases(opts, layouts, presets)
    if opts.backward:
        cases += grad_cases(opts, layouts, presets)
    return cases


def grad_refusal(parallel: ParallelConfig, backend: str, quant: QuantConfig, cfg: MoEConfig) -> str:
    """Why a gradient case cannot run ("" when it can): the forward's refusal, else the
    backward's (``moeshard.autograd.support``: every quantized scheme is refused)."""
    return refusal(parallel, backend, quant, cfg) or backward_refusal(backend, quant)


def tp_sliced_parts(cfg: MoEConfig) -> int:
    """How many of the parts whose gradient TP without EP computes differently from one device
    ``cfg`` has: expert biases (the gate_up bias sliced with I, the down bias added once, on TP
    rank 0) and weights on the input (the weighted rows' gradient summed over the TP slices)."""
    return int(cfg.expert_bias) + int(cfg.routing_kind.weights_on_input)


def grad_cases(opts: MatrixOptions, layouts: list[ParallelConfig], presets: list[str]) -> list[Case]:
    """The gradient cases among ``layouts``: every layout x backend x quant x dtype (the
    quantized schemes listed as not applicable, with the backward's reason), each with a model
    preset and token counts rotated over the layout x backend x dtype combinations that run.

    TP without EP (the experts sliced over I) rotates over its own order of the presets, those
    with the most ``tp_sliced_parts`` first, so that its few cases prove those parts (gpt-oss's
    expert biases, Llama-4's weights on the input); every other layout rotates over the presets
    in their order."""
    cases: list[Case] = []
    # Each class of layouts counts the combinations that run, so that its presets and token
    # counts rotate over them: "sliced" (TP without EP) in its own preset order, "other" in the presets'.
    counters = {"sliced": 0, "other": 0}
    orders = {"sliced": sorted(presets, key=lambda name: -tp_sliced_parts(PRESETS[name].config(opts.size))),
              "other": presets}
    for p in layouts:
        if opts.tokens_per_rank is not None and len(opts.tokens_per_rank) != p.dp:
            continue
        patterns = [opts.tokens_per_rank] if opts.tokens_per_rank is not None else TOKEN_PATTERNS[p.dp]
        kind = "sliced" if p.tp > 1 and not p.enable_ep else "other"
        order = orders[kind]
        for backend in BACKENDS:
            if opts.backends is not None and backend not in opts.backends:
                continue
            runs = support(backend, QuantConfig(), p)[0]
            for dtype in opts.dtypes:
                n = counters[kind]
                preset = order[(n + n // len(order)) % len(order)]
                tokens = tuple(patterns[n % len(patterns)])
                counters[kind] += runs
                for q in quant_configs():
                    if opts.quants is not None and q.name not in opts.quants:
                        continue
                    cfg = PRESETS[preset].config(opts.size, parse_dtype(dtype))
                    case = Case(p, backend, q, dtype, preset, opts.size, tokens, 0, grad_refusal(p, backend, q, cfg),
                                weight_seed=weight_seed_of(preset, opts.size, dtype, opts.seed), grad=True)
                    cases.append(replace(case, seed=_case_seed(case.id, opts.seed)))
    return cases


def case_from_id(case_id: str, seed: int = 0) -> Case:
    """The case an id names, built from the id alone: an id spells every axis of its case
    (``layout/backend/quant/dtype/preset[@size]/t<tokens per DP rank>[/eplb-r<R>-<skew>-<policy>][/grad]``)
    and its seed depends on the id alone, so a case listed under any filters (``--list
    --world-sizes 2``, ``--full``) runs the same under ``--only``. ValueError naming the part of
    the id that is wrong."""
    parts = case_id.split("/") if isinstance(case_id, str) else []
    grad = len(parts) >= 7 and parts[-1] == "grad"
    if grad:
        parts.pop()
    eplb = None
    if len(parts) == 7 and parts[6].startswith("eplb-"):
        eplb = _eplb_from_name(case_id, parts.pop())
    if len(parts) != 6 or not parts[5].startswith("t"):
        raise ValueError(f"{case_id!r} is not a case id: expected layout/backend/quant/dtype/preset[@size]/t<tokens>"
                         f"[/eplb-r<R>-<skew>-<policy> | /grad], e.g. dp2-tp2-ep/all2all/fp8_block/bfloat16/deepseek-v3/t1,0")
    if grad and eplb is not None:
        raise ValueError(f"{case_id!r}: gradient cases run without load balancing (a placement with replicas has "
                         f"no backward); drop /{eplb.name} or /grad")
    layout, backend, quant, dtype, preset, toks = parts
    parallel = ParallelConfig.parse(layout)
    if parallel.name != layout:
        raise ValueError(f"{case_id!r}: the layout is spelled {parallel.name!r} in case ids")
    if backend not in BACKENDS:
        raise ValueError(f"{case_id!r}: backend {backend!r} is not one of {sorted(BACKENDS)}")
    quants = {q.name: q for q in quant_configs()}
    if quant not in quants:
        raise ValueError(f"{case_id!r}: quant {quant!r} is not one of {sorted(quants)}")
    if dtype not in DTYPES + ("float16",):
        raise ValueError(f"{case_id!r}: dtype {dtype!r} is not one of {list(DTYPES) + ['float16']}")
    preset, _, size = preset.partition("@")
    size = size or "small"
    if preset not in PRESETS or size not in SIZES or size == "small" and "@" in parts[4]:
        raise ValueError(f"{case_id!r}: {parts[4]!r} is not a preset ({sorted(PRESETS)}) with an optional "
                         f"@medium or @full")
    try:
        tokens = tuple(int(t) for t in toks[1:].split(","))
    except ValueError:
        raise ValueError(f"{case_id!r}: {toks!r} is not t<tokens per DP rank>, e.g. t1,0") from None
    if len(tokens) != parallel.dp or any(not 0 <= t <= MAX_TOKENS_PER_RANK for t in tokens):
        raise ValueError(f"{case_id!r}: {toks!r} must give {parallel.dp} token counts in [0, {MAX_TOKENS_PER_RANK}], "
                         f"one per DP rank")
    q = quants[quant]
    cfg = PRESETS[preset].config(size, parse_dtype(dtype))
    reason = grad_refusal(parallel, backend, q, cfg) if grad else refusal(parallel, backend, q, cfg, eplb)
    case = Case(parallel, backend, q, dtype, preset, size, tokens, 0, reason,
                weight_seed=weight_seed_of(preset, size, dtype, seed), eplb=eplb, grad=grad)
    if case.id != case_id:
        raise ValueError(f"{case_id!r} is not a case id as moeshard check writes it (did you mean {case.id!r}?)")
    return replace(case, seed=_case_seed(case.id, seed))


def _eplb_from_name(case_id: str, name: str) -> EPLBCase:
    """The ``EPLBCase`` of an id's last part, ``eplb-r<R>-<skew>-<policy>``."""
    fields = name.split("-")
    if (len(fields) != 4 or not fields[1].startswith("r") or not fields[1][1:].isdigit()
            or int(fields[1][1:]) not in EPLB_REDUNDANT or fields[2] not in EPLB_SKEWS or fields[3] not in EPLB_POLICIES):
        raise ValueError(f"{case_id!r}: {name!r} is not eplb-r<R>-<skew>-<policy> with R in {list(EPLB_REDUNDANT)}, "
                         f"skew in {list(EPLB_SKEWS)}, policy in {list(EPLB_POLICIES)}")
    return EPLBCase(int(fields[1][1:]), fields[2], fields[3])


def _case_seed(case_id: str, seed: int) -> int:
    """The seed of a case: a function of its id (and --seed) alone, so `--only ID` reproduces it."""
    return (zlib.crc32(case_id.encode()) + seed * 7919) % 2**31


def _eplb_case(opts: MatrixOptions, p: ParallelConfig, backend: str, q: QuantConfig, dtype: str, preset: str,
               tokens: tuple[int, ...], eplb: EPLBCase) -> Case:
    cfg = PRESETS[preset].config(opts.size, parse_dtype(dtype))
    case = Case(p, backend, q, dtype, preset, opts.size, tuple(tokens), 0, refusal(p, backend, q, cfg, eplb),
                weight_seed=weight_seed_of(preset, opts.size, dtype, opts.seed), eplb=eplb)
    return replace(case, seed=_case_seed(case.id, opts.seed))


def eplb_cases(opts: MatrixOptions, layouts: list[ParallelConfig], presets: list[str]) -> list[Case]:
    """The load-balancing cases among ``layouts`` (the EP ones): ``DEFAULT_EPLB`` (a few), and
    with ``opts.eplb == "full"`` every EP layout x EP backend x redundant slots per rank
    (``EPLB_REDUNDANT``) x skew, rotating quantization, dtype, preset, policy and token counts.
    The axis filters of ``opts`` apply."""
    quants = [q for q in quant_configs() if opts.quants is None or q.name in opts.quants]
    dtypes = list(opts.dtypes)
    backends = [b for b, spec in BACKENDS.items() if spec.layouts == "ep" and (opts.backends is None or b in opts.backends)]
    ep_layouts = [p for p in layouts if p.enable_ep]
    cases: dict[str, Case] = {}

    def tokens_for(p: ParallelConfig, n: int) -> tuple[int, ...] | None:
        if opts.tokens_per_rank is not None:
            return tuple(opts.tokens_per_rank) if len(opts.tokens_per_rank) == p.dp else None
        patterns = TOKEN_PATTERNS[p.dp]
        return tuple(patterns[n % len(patterns)])

    for n, (layout, backend, quant, dtype, r, skew, policy) in enumerate(DEFAULT_EPLB):
        p = ParallelConfig.parse(layout)
        q = next((c for c in quants if c.name == quant), None)
        tokens = tokens_for(p, n)
        if p in ep_layouts and backend in backends and q is not None and dtype in dtypes and tokens is not None:
            usable = presets_for(q, presets, opts.size)
            c = _eplb_case(opts, p, backend, q, dtype, usable[n % len(usable)], tokens, EPLBCase(r, skew, policy))
            cases[c.id] = c
    if opts.eplb == "full" and quants and dtypes:
        # n counts every combination of the unfiltered matrix, so a case's rotated axes (and its
        # id) do not depend on which layouts or backends the filters keep.
        every_ep = [ParallelConfig(*t) for w in sorted(LAYOUTS) for t in LAYOUTS[w] if t[2]]
        n = 0
        for p in every_ep:
            for backend in (b for b, spec in BACKENDS.items() if spec.layouts == "ep"):
                for r in EPLB_REDUNDANT:
                    for skew in EPLB_SKEWS:
                        tokens = tokens_for(p, n)
                        if p in ep_layouts and backend in backends and tokens is not None:
                            q = quants[n % len(quants)]
                            dtype = dtypes[(n // len(quants) + n) % len(dtypes)]
                            eplb = EPLBCase(r, skew, EPLB_POLICIES[(n // 2) % len(EPLB_POLICIES)])
                            # A quantized shared expert needs a preset with shared experts.
                            usable = presets_for(q, presets, opts.size)
                            c = _eplb_case(opts, p, backend, q, dtype, usable[(3 * n + 1) % len(usable)], tokens, eplb)
                            cases.setdefault(c.id, c)
                        n += 1
    return list(cases.values())


def select_ids(cases: list[Case], ids: list[str], seed: int = 0) -> list[Case]:
    """The cases named in ``ids`` (``--only``), in the given order: each from ``cases`` when it is
    there, else built from the id itself (``case_from_id``), so any id ``--list`` prints, under
    any filters, is accepted. An id that names no case is an error."""
    by_id = {c.id: c for c in cases}
    chosen = []
    for i in ids:
        if i in by_id:
            chosen.append(by_id[i])
            continue
        try:
            chosen.append(case_from_id(i, seed))
        except ValueError as exc:
            raise ValueError(f"--only: no case with id {i!r}: {str(exc).removeprefix(repr(i) + ': ')}") from None
    return chosen
