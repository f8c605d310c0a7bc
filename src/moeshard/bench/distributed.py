"""``moeshard bench --world-size N``: the whole layer across N GPUs, per layout x backend x quant.

Every rank runs the same plan (``rank_records``); rank 0 gathers the figures. For each model
(full size, identical random weights on every rank), quantization and token count per rank:

* ``layer`` eager and, where the backend is graph-safe, ``graph`` (CUDA-graph replay): the
  median over ``reps`` calls of one forward on this rank (tokens differ per DP rank; the TP ranks
  of a DP rank share them), the slowest rank reported;
* ``dispatch`` and ``combine`` alone for EP backends (graph-replayed where graph-safe), with the
  payload they move (routed rows x row bytes, each way);
* baselines of the same run: the raw NCCL ``all_to_all_single`` moving the same bytes each way,
  the layer under DP without EP on the same GPUs (the ``DP`` run: no communication at all) and
  the layer on one GPU (``1 GPU``: each rank alone, no process group).

Timing as in the one-GPU bench (``moeshard.bench.timing``): CUDA events around each call, an L2
flush before each, ranks in lock-step through the layer's own collectives.
"""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moeshard.bench.timing import L2Flush, graphed, release_memory, time_cuda, time_host
from moeshard.bench.workload import ModelOnDevice, check_choices, hidden_states, make_model
from moeshard.config import QuantConfig
from moeshard.dispatch.packing import SlotLayout
from moeshard.dispatch.payload import prepare
from moeshard.dispatch.registry import BACKENDS, build_groups, ep_backends
from moeshard.layer import MoELayer
from moeshard.parallel.config import ParallelConfig
from moeshard.parallel.groups import ParallelGroups
from moeshard.parallel.sequence import sequence_parallel_chunk
from moeshard.presets import PRESETS, SIZES
from moeshard.validate import positive_int
from moeshard.weights import MoEWeights


@dataclass(frozen=True)
class LayoutRun:
    """One column of the tables: a name, a layout and the backend it runs."""

    name: str
    parallel: ParallelConfig
    backend: str


def default_runs(world: int) -> tuple[LayoutRun, ...]:
    """DP (no communication), EP with every registered EP backend, TP, and SP with every EP
    backend (the registry's order)."""
    dp, ep = ParallelConfig(world, 1, False), ParallelConfig(world, 1, True)
    tp, sp = ParallelConfig(1, world, False), ParallelConfig(1, world, True)
    return (LayoutRun("DP", dp, "local"),
            *(LayoutRun(f"EP{world} {b}", ep, b) for b in ep_backends()),
            LayoutRun(f"TP{world}", tp, "local"),
            *(LayoutRun(f"SP{world} {b}", sp, b) for b in ep_backends()))


@dataclass(frozen=True)
class DistOptions:
    """What to run. low_latency_max: low_latency runs only at token counts up to this (its
    buffers and traffic are sized for the worst case of routing, so it is a decode path)."""

    world_size: int
    device: str = "cuda"
    size: str = "full"
    models: tuple[str, ...] = ("qwen3-30b-a3b", "deepseek-v3")
    quants: tuple[str, ...] = ("none", "fp8_block")
    decode_tokens: tuple[int, ...] = (1, 16, 128)
    prefill_tokens: tuple[int, ...] = (1024, 4096, 16384)
    runs: tuple[str, ...] | None = None
    reps: int = 20
    low_latency_max: int = 1024
    graphs: bool = True
    seed: int = 0

    def validate(self) -> None:
        positive_int("DistOptions", "world_size", self.world_size)
        positive_int("DistOptions", "reps", self.reps)
        check_choices(self.models, self.quants)
        known = [r.name for r in default_runs(self.world_size)]
        for name in self.runs or ():
            if name not in known:
                raise ValueError(f"bench: --runs {name!r} is not one of {known}")
        for tokens in self.decode_tokens + self.prefill_tokens:
            positive_int("DistOptions", "tokens", tokens)
        if self.size not in SIZES:
            raise ValueError(f"--size: {self.size!r} is not one of {list(SIZES)}")
        # Every run's layout against every model's shape, here: inside the ranks a layout that
        # does not fit would surface only after the runs before it.
        for name in self.models:
            cfg = PRESETS[name].config(self.size)
            for run in self.selected_runs():
                try:
                    run.parallel.validate(self.world_size, cfg)
                except ValueError as exc:
                    raise ValueError(f"--world-size {self.world_size}: run {run.name!r} of {name} ({self.size}): "
                                     f"{exc}") from None

    def memory_bytes(self) -> int:
        """Bytes all local ranks hold at their peak, from the shapes (an estimate, on CUDA one
        GPU's): the largest model's weights twice (made, and the layer's copy) in fp32, and the
        largest token count's rows with their routed copies and the experts' intermediate rows."""
        tokens = max(self.decode_tokens + self.prefill_tokens)
        need = 0
        for name in self.models:
            cfg = PRESETS[name].config(self.size)
            E, H, I, K = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size, cfg.top_k
            need = max(need, 2 * 3 * E * H * I * 4 + tokens * 4 * (H * (2 + 3 * K) + 3 * K * I))
        return need if self.device == "cuda" else need * self.world_size

    def selected_runs(self) -> tuple[LayoutRun, ...]:
        return tuple(r for r in default_runs(self.world_size) if self.runs is None or r.name in self.runs)


def _median_ms(fn: Callable[[], object], reps: int, flush: L2Flush | None, graph: bool) -> tuple[float | None, str | None]:
    """(median ms, None) or (None, error); graph: capture fn and time its replays. ``flush``
    None: CPU ranks, host timing (and no graphs)."""
    g = None
    try:
        if flush is None:
            return time_host(fn, warmup=2, reps=reps).median_ms, None
        if graph:
            g = graphed(fn)
            return time_cuda(g, warmup=2, reps=reps, flush=flush).median_ms, None
        return time_cuda(fn, warmup=2, reps=reps, flush=flush).median_ms, None
    except Exception as exc:  # one configuration failing must not end the run; it is reported
        if flush is not None:
            torch.cuda.synchronize()
        return None, f"{type(exc).__name__}: {str(exc)[:300]}"
    finally:
        if g is not None:
            g.release()


def _full_weights(model: ModelOnDevice) -> MoEWeights:
    s = model.shell
    return MoEWeights(gate=s.gate, gate_up=model.gate_up, down=model.down, correction_bias=s.correction_bias,
                      shared_gate=s.shared_gate, shared_up=s.shared_up, shared_down=s.shared_down,
                      shared_expert_gate=s.shared_expert_gate)


def _raw_all_to_all(nbytes: int, group, device: torch.device, reps: int, flush: L2Flush | None) -> float | None:
    """Median ms of one equal-split ``all_to_all_single`` of ``nbytes`` bytes per rank."""
    world = dist.get_world_size(group)
    per = max(1, -(-nbytes // world))
    send = torch.empty(world * per, dtype=torch.uint8, device=device)
    recv = torch.empty_like(send)
    ms, _ = _median_ms(lambda: dist.all_to_all_single(recv, send, group=group), reps, flush, graph=False)
    return ms


def _tokens(opts: DistOptions, run: LayoutRun) -> list[int]:
    tokens = list(opts.decode_tokens) + list(opts.prefill_tokens)
    if BACKENDS[run.backend].needs_max_tokens:
        tokens = [t for t in tokens if t <= opts.low_latency_max]
    return tokens


def _measure(layer: MoELayer, run: LayoutRun, x: torch.Tensor, opts: DistOptions, flush: L2Flush | None,
             ep_group) -> dict:
    reps = opts.reps if x.shape[0] <= 1024 else max(3, opts.reps // 4)
    spec = BACKENDS[run.backend]
    rec: dict = {}
    rec["layer_ms"], err = _median_ms(lambda: layer(x), reps, flush, graph=False)
    if err:
        rec["layer_error"] = err
    graphs = opts.graphs and flush is not None
    if graphs and spec.graph_safe:
        rec["graph_ms"], err = _median_ms(lambda: layer(x), reps, flush, graph=True)
        if err:
            rec["graph_error"] = err
    if run.parallel.enable_ep and "layer_error" not in rec:
        xr = x
        if run.parallel.is_sequence_parallel:
            xr, _ = sequence_parallel_chunk(x, run.parallel.tp_rank(dist.get_rank()), run.parallel.tp)
        routing = layer.route(xr)
        d = layer.backend.dispatch(xr, routing)
        y = layer.kernel(d.input, layer.experts.weights)
        graph = graphs and spec.graph_safe
        rec["dispatch_ms"], _ = _median_ms(lambda: layer.backend.dispatch(xr, routing), reps, flush, graph)
        rec["combine_ms"], _ = _median_ms(lambda: layer.backend.combine(y, d), reps, flush, graph)
        slot = SlotLayout.of(prepare(xr, layer.quant))
        # Every rank times the raw all-to-all on the same bytes: the busiest rank's payload (under
        # SP, TP rank 0's chunk is the largest).
        rows = -(-x.shape[0] // run.parallel.tp) if run.parallel.is_sequence_parallel else x.shape[0]
        pairs = rows * layer.cfg.top_k
        rec["dispatch_bytes"] = pairs * (slot.data + slot.scale)
        rec["combine_bytes"] = pairs * layer.cfg.hidden_size * y.element_size()
        rec["raw_dispatch_ms"] = _raw_all_to_all(rec["dispatch_bytes"], ep_group, x.device, reps, flush)
        rec["raw_combine_ms"] = _raw_all_to_all(rec["combine_bytes"], ep_group, x.device, reps, flush)
    return rec


def _one_gpu(model: ModelOnDevice, quant: QuantConfig, full: MoEWeights, opts: DistOptions, flush: L2Flush | None,
             rank: int) -> list[dict]:
    """The ``1 GPU`` baseline: the layer alone on this rank's device, no process group."""
    alone = MoELayer(model.cfg, quant, weights=full, device=model.gate_up.device)
    graph = opts.graphs and flush is not None
    out = []
    for T in list(opts.decode_tokens) + list(opts.prefill_tokens):
        x = hidden_states(model, T, opts.seed * 1000 + rank)
        reps = opts.reps if T <= 1024 else max(3, opts.reps // 4)
        ms, err = _median_ms(functools.partial(alone, x), reps, flush, graph)
        out.append({"model": model.name, "quant": quant.scheme, "tokens": T, "run": "1 GPU", "rank": rank,
                    "graph_ms" if graph else "layer_ms": ms, **({"error": err} if err else {})})
    return out


def rank_records(opts: DistOptions, progress: Callable[[str], None] = lambda s: None) -> list[dict]:
    """Runs the plan on this rank (every rank of an initialised NCCL world of ``world_size``
    ranks calls it); returns this rank's records."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != opts.world_size:
        raise ValueError(f"bench (rank {rank}): the world has {world} ranks, --world-size is {opts.world_size}")
    cuda = opts.device == "cuda"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    flush = L2Flush(device) if cuda else None
    runs = opts.selected_runs()
    groups: dict[ParallelConfig, ParallelGroups] = {}
    for run in runs:  # created in the same order on every rank
        if run.parallel not in groups:
            backends = [r.backend for r in runs if r.parallel == run.parallel]
            groups[run.parallel] = build_groups(run.parallel, opts.device, backends)
    records: list[dict] = []
    for name in opts.models:
        progress(f"{name}: {opts.size} weights on every rank")
        model = make_model(name, device, opts.seed, opts.size)
        full = _full_weights(model)
        for scheme in opts.quants:
            quant = QuantConfig(scheme)
            records += _one_gpu(model, quant, full, opts, flush, rank)
            gc.collect()
            if cuda:
                release_memory()
            for run in runs:
                g = groups[run.parallel]
                tokens = _tokens(opts, run)
                if not tokens:
                    continue
                progress(f"{name} {scheme} {run.name}: tokens {tokens}")
                layer = MoELayer(model.cfg, quant, groups=g, backend=run.backend, weights=full, device=device,
                                 max_tokens_per_rank=max(tokens))
                dp_rank = run.parallel.dp_rank(rank)
                for T in tokens:
                    x = hidden_states(model, T, opts.seed * 1000 + dp_rank)
                    rec = {"model": name, "quant": scheme, "tokens": T, "run": run.name, "layout": run.parallel.name,
                           "backend": run.backend, "rank": rank}
                    rec.update(_measure(layer, run, x, opts, flush, g.ep_group))
                    records.append(rec)
                del layer
                gc.collect()
                if cuda:
                    release_memory()
        del model, full
        gc.collect()
        if cuda:
            release_memory()
    dist.barrier()
    return records


def merge(per_rank: list[list[dict]]) -> list[dict]:
    """One record per (model, quant, tokens, run): the slowest rank's times (a layer is as fast
    as its slowest rank), payload bytes of rank 0, and every rank's layer time."""
    merged: dict[tuple, dict] = {}
    for records in per_rank:
        for r in records:
            key = (r["model"], r["quant"], r["tokens"], r["run"])
            m = merged.setdefault(key, {k: v for k, v in r.items() if k != "rank"} | {"per_rank_ms": {}})
            for k, v in r.items():
                if k.endswith("_ms") and v is not None:
                    m[k] = max(m.get(k) or 0.0, v)
            t = r.get("graph_ms") or r.get("layer_ms")
            m["per_rank_ms"][r["rank"]] = t
    return list(merged.values())


def derive(records: list[dict]) -> None:
    """Adds same-run ratios: layer over the DP run (no communication) and over one GPU; payload
    GB/s of dispatch and combine; their bandwidth over the raw NCCL all-to-all's."""
    def best(r: dict) -> float | None:
        return r.get("graph_ms") or r.get("layer_ms")

    base = {(r["model"], r["quant"], r["tokens"], r["run"]): best(r) for r in records}
    for r in records:
        t = best(r)
        dp = base.get((r["model"], r["quant"], r["tokens"], "DP"))
        one = base.get((r["model"], r["quant"], r["tokens"], "1 GPU"))
        ratios = {}
        if t and dp:
            ratios["vs_dp"] = t / dp
        if t and one:
            ratios["vs_one_gpu"] = t / one
        if r.get("dispatch_ms") and r.get("combine_ms"):
            comm = r["dispatch_ms"] + r["combine_ms"]
            r["dispatch_gbps"] = r["dispatch_bytes"] / (r["dispatch_ms"] * 1e-3) / 1e9
            r["combine_gbps"] = r["combine_bytes"] / (r["combine_ms"] * 1e-3) / 1e9
            if r.get("raw_dispatch_ms") and r.get("raw_combine_ms"):
                ratios["comm_vs_raw"] = (r["raw_dispatch_ms"] + r["raw_combine_ms"]) / comm
                if t and dp:
                    ratios["layer_over_dp_plus_half_raw"] = t / (dp + 0.5 * (r["raw_dispatch_ms"] + r["raw_combine_ms"]))
        r["ratios"] = ratios
