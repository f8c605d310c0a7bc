"""The verification matrix: layouts x backends x quants x dtypes x shapes x token counts.

Every combination the support registry or the sharding rules refuse is kept as a skipped case
with the refusal's reason, so a run says exactly what it did not run and why.
"""

from __future__ import annotations

import itertools
import zlib
from dataclasses import dataclass, field, replace

from moeshard.config import MoEConfig, QuantConfig, parse_dtype
from moeshard.dispatch.registry import BACKENDS, support
from moeshard.eplb.placement import Layout
from moeshard.quant import scheme_names
from moeshard.parallel.config import ParallelConfig
from moeshard.presets import PRESETS
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



def quant_configs() -> list[QuantConfig]:
    """Every registered scheme, then every quantized one with deferred input quantization."""
    names = scheme_names()
    return [QuantConfig(s) for s in names] + [QuantConfig(s, True) for s in names if s != "none"]

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
    """One verification case. ``tokens``: tokens per DP rank; ``reason``: why it is skipped."""

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
    eplb: EPLBCase | None = None

    def __post_init__(self) -> None:
        if not self.id:
            q = self.quant.name
            size = "" if self.size == "small" else f"@{self.size}"
            toks = ",".join(map(str, self.tokens))
            eplb = "" if self.eplb is None else f"/{self.eplb.name}"
            object.__setattr__(self, "id", f"{self.parallel.name}/{self.backend}/{q}/{self.dtype}/"
                                           f"{self.preset}{size}/t{toks}{eplb}")

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


def refusal(parallel: ParallelConfig, backend: str, quant: QuantConfig, cfg: MoEConfig,
            eplb: EPLBCase | None = None) -> str:
    """The reason this combination cannot run, or "" when it can (same checks as the layer)."""
    ok, reason = support(backend, quant, parallel)
    if not ok:
        return reason
    try:
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
    """Filters and axes of the matrix (None = the defaults)."""

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

    def __post_init__(self) -> None:
        if self.eplb not in EPLB_MODES:
            raise ValueError(f"eplb: {self.eplb!r} is not one of {list(EPLB_MODES)}")
        for w in self.world_sizes:
            if w not in LAYOUTS:
                raise ValueError(f"--world-sizes: {w} is not one of {sorted(LAYOUTS)}")
        for b in self.backends or ():
            if b not in BACKENDS:
                raise ValueError(f"--backends: {b!r} is not one of {sorted(BACKENDS)}")
        known = {q.name for q in quant_configs()}
        for q in self.quants or ():
            if q not in known:
                raise ValueError(f"--quants: {q!r} is not one of {sorted(known)}")
        for d in self.dtypes:
            parse_dtype(d)
        for p in self.presets or ():
            if p not in PRESETS:
                raise ValueError(f"--presets: {p!r} is not one of {sorted(PRESETS)}")
        if self.tokens_per_rank is not None and any(t < 0 for t in self.tokens_per_rank):
            raise ValueError(f"--tokens-per-rank: counts must be >= 0, got {list(self.tokens_per_rank)}")


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
                for dtype in opts.dtypes:
                    n = next(rotation)
                    chosen = presets if opts.all_presets else [presets[n % len(presets)]]
                    for k, preset in enumerate(chosen):
                        tokens = patterns[(n + k) % len(patterns)]
                        cfg = PRESETS[preset].config(opts.size, parse_dtype(dtype))
                        reason = refusal(p, backend, q, cfg)
                        case = Case(p, backend, q, dtype, preset, opts.size, tuple(tokens), 0, reason)
                        # The seed depends on the id alone, so `--only ID` reproduces a case exactly.
                        cases.append(replace(case, seed=(zlib.crc32(case.id.encode()) + opts.seed * 7919) % 2**31))
    if opts.eplb != "off":
        cases += eplb_cases(opts, layouts, presets)
    return cases


def _eplb_case(opts: MatrixOptions, p: ParallelConfig, backend: str, q: QuantConfig, dtype: str, preset: str,
               tokens: tuple[int, ...], eplb: EPLBCase) -> Case:
    cfg = PRESETS[preset].config(opts.size, parse_dtype(dtype))
    case = Case(p, backend, q, dtype, preset, opts.size, tuple(tokens), 0, refusal(p, backend, q, cfg, eplb),
                eplb=eplb)
    return replace(case, seed=(zlib.crc32(case.id.encode()) + opts.seed * 7919) % 2**31)


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
            c = _eplb_case(opts, p, backend, q, dtype, presets[n % len(presets)], tokens, EPLBCase(r, skew, policy))
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
                            c = _eplb_case(opts, p, backend, q, dtype, presets[(3 * n + 1) % len(presets)], tokens, eplb)
                            cases.setdefault(c.id, c)
                        n += 1
    return list(cases.values())


def select_ids(cases: list[Case], ids: list[str]) -> list[Case]:
    """The cases named in ``ids`` (``--only``), in the given order; unknown ids are an error."""
    by_id = {c.id: c for c in cases}
    missing = [i for i in ids if i not in by_id]
    if missing:
        raise ValueError(f"--only: no case with id {missing[0]!r} in this matrix "
                         f"(see `moeshard check --list` with the same filters)")
    return [by_id[i] for i in ids]
