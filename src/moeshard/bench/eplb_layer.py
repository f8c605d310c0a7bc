"""``moeshard eplb --layer``: the EP layer's time under skewed routing, with and without replicas,
in one run (the same weights, tokens and ranks for every row).

Every rank (EP over all ranks: layout dp=N, tp=1, one process per GPU, or CPU ranks on gloo):

    weights: the preset at ``size`` (random; on CUDA generated on the GPU), router skewed by
             ``moeshard.eplb.skew`` (``skew``: zipf or one) and the tokens with it
    1. the layer without redundancy: time one forward (median of ``reps``), then count its loads
       (``MoELayer.expert_loads``, all-reduced) and the routed copies each rank computes
    2. for each number of redundant slots per rank: the policy's placement for those loads; a
       layer built with ``Placement.initial`` then ``rebalance``d to it (timed: the weight moves),
       then the forward timed as in 1, and its routed copies per rank

The figure of a row is its slowest rank's median (a step waits for the slowest rank). On CPU
ranks the times check the plumbing and say nothing about GPUs.
"""

from __future__ import annotations

import gc
import time
from dataclasses import asdict, dataclass, replace

import torch
import torch.distributed as dist

from moeshard.bench.timing import L2Flush, release_memory, time_cuda, time_host
from moeshard.config import QuantConfig
from moeshard.dispatch.registry import BACKENDS, build_groups, ep_backends
from moeshard.eplb.placement import Layout, Placement
from moeshard.eplb.policies import balancedness, get_policy
from moeshard.eplb.skew import SKEWS, skew_bias, skew_gate, skew_tokens
from moeshard.layer import MoELayer
from moeshard.parallel.config import ParallelConfig
from moeshard.presets import PRESETS, SIZES
from moeshard.validate import nonneg_int, positive_int
from moeshard.weights import MoEWeights

DEFAULT_REDUNDANT = (0, 2, 8, 32)


@dataclass(frozen=True)
class LayerOptions:
    """What ``moeshard eplb --layer`` runs (defaults: DeepSeek-V3's block at full size on EP2)."""

    world_size: int = 2
    device: str = "cuda"
    preset: str = "deepseek-v3"
    size: str = "full"
    tokens: int = 4096
    skew: str = "zipf"
    # None: DEFAULT_REDUNDANT, less the counts that do not fit the preset's experts on
    # ``world_size`` ranks (small presets hold fewer experts than 32 redundant slots would need).
    redundant_per_rank: tuple[int, ...] | None = None
    policy: str = "hierarchical"
    backend: str = "all2all"
    quant: str = "none"
    reps: int = 10
    seed: int = 0

    def __post_init__(self) -> None:
        positive_int("LayerOptions", "world_size", self.world_size)
        positive_int("LayerOptions", "tokens", self.tokens)
        positive_int("LayerOptions", "reps", self.reps)
        if self.world_size < 2:
            raise ValueError(f"--world-size: expert parallelism needs at least 2 ranks, got {self.world_size}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"--device: {self.device!r} is not one of ['cpu', 'cuda']")
        if self.preset not in PRESETS:
            raise ValueError(f"--preset: {self.preset!r} is not one of {sorted(PRESETS)}")
        if self.size not in SIZES:
            raise ValueError(f"--size: {self.size!r} is not one of {list(SIZES)}")
        if self.skew not in SKEWS:
            raise ValueError(f"--skew: {self.skew!r} is not one of {list(SKEWS)}")
        if self.backend not in BACKENDS or BACKENDS[self.backend].layouts != "ep":
            raise ValueError(f"--backend: {self.backend!r} is not one of "
                             f"{sorted(b for b, s in BACKENDS.items() if s.layouts == 'ep')}")
        QuantConfig(self.quant)
        get_policy(self.policy)
        E = PRESETS[self.preset].config(self.size).num_experts
        if E % self.world_size:
            raise ValueError(f"--world-size {self.world_size}: {self.preset} ({self.size}) has {E} experts, which "
                             f"do not divide over {self.world_size} ranks")
        if self.redundant_per_rank is None:
            fits = tuple(r for r in DEFAULT_REDUNDANT if r <= E - E // self.world_size)
            object.__setattr__(self, "redundant_per_rank", fits)  # frozen: resolved once, here
        assert self.redundant_per_rank is not None  # resolved just above
        for r in self.redundant_per_rank:
            nonneg_int("LayerOptions", "redundant_per_rank", r)
            Layout(E, self.world_size, r)


def memory_bytes(opts: LayerOptions) -> int:
    """Bytes all ranks on this machine hold at their peak, from the shapes (an estimate: weights
    in fp32 made on every rank, the layer's shard with its redundant slots, the tokens with their
    routed copies and the experts' intermediate rows). On CUDA the figure is one GPU's."""
    cfg = PRESETS[opts.preset].config(opts.size)
    E, H, I, K = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size, cfg.top_k
    slots = E // opts.world_size + max(opts.redundant_per_rank or (0,))
    weights = 3 * H * I * 4 * (E + 2 * slots)  # made, then the start and the rebalanced layer
    tokens = opts.tokens * 4 * (H * (2 + 3 * K) + 3 * K * I)
    per_rank = weights + tokens
    return per_rank if opts.device == "cuda" else per_rank * opts.world_size


def _weights(opts: LayerOptions, device: torch.device) -> tuple:
    cfg = PRESETS[opts.preset].config(opts.size, torch.bfloat16 if opts.device == "cuda" else torch.float32)
    if opts.device == "cuda":
        from moeshard.bench.workload import make_model

        m = make_model(opts.preset, device, opts.seed, opts.size)
        s = m.shell
        weights = MoEWeights(gate=s.gate, gate_up=m.gate_up, down=m.down, correction_bias=s.correction_bias,
                             shared_gate=s.shared_gate, shared_up=s.shared_up, shared_down=s.shared_down,
                             shared_expert_gate=s.shared_expert_gate)
    else:
        weights = MoEWeights.random(cfg, torch.Generator().manual_seed(opts.seed))
    g = torch.Generator().manual_seed(opts.seed * 7919 + 3)
    u = torch.randn(cfg.hidden_size, generator=g)
    weights = replace(weights, gate=skew_gate(weights.router_weight, u, skew_bias(cfg.num_experts, opts.skew, g)))
    return cfg, weights, u


def _rank_copies(layer: MoELayer, x: torch.Tensor) -> list[int]:
    """Routed copies each EP rank computes for this forward's tokens (all-reduced)."""
    slots = layer.physical_ids(layer.route(x).topk_ids)
    dest = torch.div(slots.flatten(), layer.placement.slots_per_rank, rounding_mode="floor")
    counts = torch.zeros(layer.placement.num_ranks, dtype=torch.int64, device=x.device)
    counts.scatter_add_(0, dest, torch.ones_like(dest))
    assert layer.groups is not None  # this bench builds every layer on its process groups
    dist.all_reduce(counts, group=layer.groups.ep_group)
    return counts.tolist()


def rank_records(opts: LayerOptions, progress=lambda s: None) -> list[dict]:
    """Runs the plan on this rank (every rank of an initialised world of ``world_size``)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != opts.world_size:
        raise ValueError(f"eplb (rank {rank}): the world has {world} ranks, --world-size is {opts.world_size}")
    cuda = opts.device == "cuda"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    flush = L2Flush(device) if cuda else None
    parallel = ParallelConfig(world, 1, True)
    groups = build_groups(parallel, opts.device, ep_backends())
    progress(f"{opts.preset} ({opts.size}) weights on every rank, router skewed ({opts.skew})")
    cfg, weights, u = _weights(opts, device)
    gen = torch.Generator().manual_seed(opts.seed * 1000 + rank)
    x = skew_tokens(torch.randn(opts.tokens, cfg.hidden_size, generator=gen), u).to(device=device, dtype=cfg.dtype)
    quant = QuantConfig(opts.quant)

    def timed(layer: MoELayer) -> float:
        if cuda:
            return time_cuda(lambda: layer(x), warmup=2, reps=opts.reps, flush=flush).median_ms
        return time_host(lambda: layer(x), warmup=1, reps=opts.reps).median_ms

    def build(placement: Placement | None) -> MoELayer:
        return MoELayer(cfg, quant, groups=groups, backend=opts.backend, weights=weights, device=device,
                        max_tokens_per_rank=opts.tokens, placement=placement)

    records: list[dict] = []
    layer = build(None)
    progress("no redundancy")
    ms = timed(layer)
    layer.reset_expert_loads()
    layer(x)
    loads = layer.expert_loads()
    copies = _rank_copies(layer, x)
    records.append({"run": "no replicas", "redundant_per_rank": 0, "rank": rank, "layer_ms": ms,
                    "rank_copies": copies, "balancedness": balancedness(copies)})
    del layer
    assert opts.redundant_per_rank is not None  # LayerOptions resolves the default
    for r in opts.redundant_per_rank:
        layout = Layout(cfg.num_experts, world, r)
        start = Placement.identity(cfg.num_experts, world) if r == 0 else Placement.initial(layout)
        target = get_policy(opts.policy)(loads, layout).aligned_to(start)
        gc.collect()
        if cuda:
            release_memory()
        progress(f"{opts.policy}, {r} redundant slots per rank")
        layer = build(start)
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        stats = layer.rebalance(target)
        if cuda:
            torch.cuda.synchronize()
        rebalance_ms = (time.perf_counter() - t0) * 1e3
        ms = timed(layer)
        copies = _rank_copies(layer, x)
        records.append({"run": f"{opts.policy} R/rank {r}", "redundant_per_rank": r, "rank": rank, "layer_ms": ms,
                        "rank_copies": copies, "balancedness": balancedness(copies),
                        "replicated_experts": sum(1 for e in range(cfg.num_experts) if len(target.replicas(e)) > 1),
                        "rebalance_ms": rebalance_ms, "moved_slots": stats.rewritten,
                        "moved_bytes_received": stats.bytes_received})
        del layer
    dist.barrier()
    return records


def merge(per_rank: list[list[dict]]) -> list[dict]:
    """One record per run: the slowest rank's times, every rank's time and moved slots."""
    out = []
    for i, first in enumerate(per_rank[0]):
        rows = [records[i] for records in per_rank]
        rec = {k: v for k, v in first.items() if k not in ("rank", "layer_ms", "rebalance_ms", "moved_slots",
                                                           "moved_bytes_received")}
        rec["layer_ms"] = max(r["layer_ms"] for r in rows)
        rec["per_rank_ms"] = [r["layer_ms"] for r in rows]
        if "rebalance_ms" in first:
            rec["rebalance_ms"] = max(r["rebalance_ms"] for r in rows)
            rec["moved_slots_per_rank"] = [r["moved_slots"] for r in rows]
        out.append(rec)
    base = out[0]["layer_ms"]
    for rec in out:
        rec["vs_no_replicas"] = rec["layer_ms"] / base if base else None
    return out


def format_report(result: dict) -> str:
    o = result["options"]
    lines = [(f"EP{o['world_size']} layer under skew ({o['skew']}): {o['preset']} ({o['size']}), {o['tokens']} tokens "
              f"per rank, backend {o['backend']}, quant {o['quant']}, {o['device']}; median of {o['reps']}, slowest rank"),
             "", (f"{'run':<26}{'layer ms':>10}{'vs none':>9}{'balancedness':>14}{'copies per rank':>26}"
                  f"{'rebalance ms':>14}{'moved slots':>13}")]
    for r in result["records"]:
        lines.append(f"{r['run']:<26}{r['layer_ms']:>10.2f}{r['vs_no_replicas']:>9.3f}{r['balancedness']:>14.3f}"
                     f"{r['rank_copies']!s:>26}{r.get('rebalance_ms', float('nan')):>14.1f}"
                     f"{r.get('moved_slots_per_rank', '')!s:>13}")
    if o["device"] == "cpu":
        lines.append("(CPU ranks on gloo: these times check the plumbing and say nothing about GPUs)")
    return "\n".join(lines)


def options_dict(opts: LayerOptions) -> dict:
    return asdict(opts)
