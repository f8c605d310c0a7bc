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


@dataclass(frozen=True)
class Case:
    """One verification case. ``tokens``: tokens per DP rank; ``seed``: of its tokens (from the id
    alone); ``weight_seed``: of its weights, the same for every case of one model shape and dtype
    (``weight_seed_of``), so that cases share weights and their quantized forms; ``reason``: why
    it is skipped."""

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

    def __post_init__(self) -> None:
        if not self.id:
            q = self.quant.name
            size = "" if self.size == "small" else f"@{self.size}"
            toks = ",".join(map(str, self.tokens))
            object.__setattr__(self, "id", f"{self.parallel.name}/{self.backend}/{q}/{self.dtype}/"
                                           f"{self.preset}{size}/t{toks}")

    @property
    def world_size(self) -> int:
        return self.parallel.world_size

    @property
    def skipped(self) -> bool:
        return bool(self.reason)

    def moe_config(self) -> MoEConfig:
        return PRESETS[self.preset].config(self.size, parse_dtype(self.dtype))

    @property
    def weights_key(self) -> tuple[str, str, str, int]:
        """What the case's weights depend on: cases with equal keys have identical weights."""
        return self.preset, self.size, self.dtype, self.weight_seed


def weight_seed_of(preset: str, size: str, dtype: str, run_seed: int = 0) -> int:
    """The weights' seed of every case of one model shape and dtype (``--seed`` shifts it)."""
    return (zlib.crc32(f"{preset}@{size}/{dtype}".encode()) + run_seed * 7919) % 2**31


def refusal(parallel: ParallelConfig, backend: str, quant: QuantConfig, cfg: MoEConfig) -> str:
    """The reason this combination cannot run, or "" when it can (same checks as the layer)."""
    ok, reason = support(backend, quant, parallel)
    if not ok:
        return reason
    try:
        parallel.validate(parallel.world_size, cfg)
        E, ep, tp = cfg.num_experts, parallel.ep_size, parallel.tp
        spec = ShardSpec(0, E // ep, 0, 1) if parallel.enable_ep else ShardSpec(0, E, 0, tp)
        spec.validate(cfg, quant)
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

    def __post_init__(self) -> None:
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
                        case = Case(p, backend, q, dtype, preset, opts.size, tuple(tokens), 0, reason,
                                    weight_seed=weight_seed_of(preset, opts.size, dtype, opts.seed))
                        # The seeds depend on the id alone, so `--only ID` reproduces a case exactly.
                        cases.append(replace(case, seed=(zlib.crc32(case.id.encode()) + opts.seed * 7919) % 2**31))
    return cases


def select_ids(cases: list[Case], ids: list[str]) -> list[Case]:
    """The cases named in ``ids`` (``--only``), in the given order; unknown ids are an error."""
    by_id = {c.id: c for c in cases}
    missing = [i for i in ids if i not in by_id]
    if missing:
        raise ValueError(f"--only: no case with id {missing[0]!r} in this matrix "
                         f"(see `moeshard check --list` with the same filters)")
    return [by_id[i] for i in ids]
