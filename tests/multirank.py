"""Multi-rank test cases for ``moeshard.parallel``, run all at once in one spawn per world size.

``build_cases(world_size)`` is deterministic: the parent builds it to know the case ids and the
expected values, each rank builds it to run the cases.  A case has

  * ``run(ctx)``: runs on every rank (collectives inside), returns a picklable value;
  * ``expect(rank, world_size)``: the value that rank must return, computed in the parent from
    first principles (the rank-tagged inputs are regenerated there), never by the code under test;
  * ``raises(rank, world_size)``: ``None``, or the exception type name and message fragments that
    rank must raise instead.

Collective cases also return the result of a plain ``torch.distributed`` reference (padding
computed here, then ``dist.all_gather`` / ``dist.all_to_all_single`` with equal sizes) next to
the op's output, and the parent checks both against the expectation.

Inputs are rank-tagged: float rows are ``global_rank * 1000 + row + column / 8`` (exact in
fp32), 1-byte floats are random bytes seeded by rank and case, so a receiver's rows say where
they came from, and every output row is compared bit for bit.
"""

from __future__ import annotations

import math
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from moeshard.parallel.collectives import all_gatherv, all_to_allv, exchange_counts, exchange_sizes, reduce_scatterv
from moeshard.parallel.config import ParallelConfig
from moeshard.parallel.groups import GROUP_NAMES, ParallelGroups
from moeshard.parallel.sequence import sequence_parallel_chunk, sequence_parallel_gather

# ----------------------------------------------------------------------------- inputs

def is_byte_float(dtype: torch.dtype) -> bool:
    return dtype.itemsize == 1 and dtype not in (torch.uint8, torch.int8, torch.bool)


def tagged(rank: int, rows: int, rest: tuple[int, ...], dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    """``[rows, *rest]`` whose values say which rank and row they are."""
    shape = (rows, *rest)
    if is_byte_float(dtype):
        gen = torch.Generator().manual_seed(10_007 * salt + rank)
        return torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8).view(dtype)
    row = torch.arange(rows, dtype=torch.float64).view(rows, *([1] * len(rest)))
    col = torch.arange(math.prod(rest), dtype=torch.float64).view(rest)
    if dtype.is_floating_point:
        return (rank * 1000 + row + (col + 1) / 8 + salt).to(dtype)
    return (rank * 1000 + row * 10 + col + salt).to(dtype)


def blocks(x: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    return list(torch.split(x, sizes))


def sum_in_rank_order(parts: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    acc = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    out = parts[0].to(acc, copy=True)
    for part in parts[1:]:
        out += part
    return out.to(dtype)


# ----------------------------------------------------------------------------- plain references

def _wire(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.uint8) if is_byte_float(x.dtype) else x  # gloo has no float8


def ref_all_gatherv(x: torch.Tensor, sizes: list[int], group: Any) -> torch.Tensor:
    cap = max(sizes)
    padded = _wire(x).new_zeros((cap, *x.shape[1:]))
    padded[: x.shape[0]] = _wire(x)
    outs = [torch.empty_like(padded) for _ in sizes]
    if cap:
        dist.all_gather(outs, padded, group=group)
    return torch.cat([o[:n] for o, n in zip(outs, sizes, strict=True)]).view(x.dtype)


def ref_reduce_scatterv(x: torch.Tensor, sizes: list[int], group: Any) -> torch.Tensor:
    everyone = [torch.empty_like(x) for _ in sizes]
    if x.numel():
        dist.all_gather(everyone, x.contiguous(), group=group)
    me = dist.get_rank(group)
    return sum_in_rank_order([blocks(e, sizes)[me] for e in everyone], x.dtype)


def ref_all_to_allv(x: torch.Tensor, send: list[int], recv: list[int], group: Any) -> torch.Tensor:
    n = len(send)
    # Pad every block to the largest block anywhere, so all ranks use the same equal splits.
    cap = torch.tensor(max(send + recv), device=x.device)
    dist.all_reduce(cap, op=dist.ReduceOp.MAX, group=group)
    cap = int(cap)
    rest = x.shape[1:]
    out_blocks = _wire(x).new_zeros((n, cap, *rest))
    in_blocks = _wire(x).new_zeros((n, cap, *rest))
    for j, block in enumerate(blocks(_wire(x), send)):
        in_blocks[j, : block.shape[0]] = block
    dist.all_to_all_single(out_blocks, in_blocks, group=group)
    return torch.cat([out_blocks[j, :m] for j, m in enumerate(recv)]).view(x.dtype)


# ----------------------------------------------------------------------------- cases

@dataclass(frozen=True)
class Ctx:
    """What a case sees on a rank: its rank, the world size and the groups it may use."""

    rank: int
    world_size: int
    device: torch.device  # cpu under gloo, this rank's GPU under NCCL
    sub: ParallelGroups | None  # ParallelConfig(dp=2, tp=world_size // 2) for world sizes >= 4

    def group(self, name: str) -> Any:
        return None if name == "world" else self.sub.group(name)

    def zeros(self, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, device=self.device)


def sub_config(world_size: int) -> ParallelConfig | None:
    return ParallelConfig(dp=2, tp=world_size // 2) if world_size >= 4 else None


def members(name: str, rank: int, world_size: int) -> list[int]:
    """Global ranks of the group ``name`` ("world", or "tp"/"dp" of ``sub_config``) holding rank."""
    if name == "world":
        return list(range(world_size))
    cfg = sub_config(world_size)
    if name == "tp":
        return [cfg.dp_rank(rank) * cfg.tp + t for t in range(cfg.tp)]
    return [d * cfg.tp + cfg.tp_rank(rank) for d in range(cfg.dp)]


@dataclass(frozen=True)
class Case:
    id: str
    run: Callable[[Ctx], Any]
    expect: Callable[[int, int], Any] = lambda rank, ws: None
    raises: Callable[[int, int], tuple[str, list[str]] | None] = lambda rank, ws: None


def size_patterns(n: int) -> dict[str, list[int]]:
    return {
        "equal": [3] * n,
        "zeros": [0] * n,
        "uneven": [(2 * g + 1) % 5 for g in range(n)],  # n=4: [1, 3, 0, 2]
        "first_empty": [0] + [g + 1 for g in range(1, n)],
        "skewed": [17] + [0] * (n - 1),
    }


def send_matrices(n: int) -> dict[str, list[list[int]]]:
    gen = torch.Generator().manual_seed(7)
    rand = torch.randint(0, 5, (n, n), generator=gen).tolist()
    rand[0][n - 1] = 0
    return {
        "random": rand,
        "silent_rank0": [[0] * n] + [[(i + j) % 4 + 1 for j in range(n)] for i in range(1, n)],
        "deaf_last": [[(i + 2 * j) % 3 + 1 if j < n - 1 else 0 for j in range(n)] for i in range(n)],
        "all_zero": [[0] * n for _ in range(n)],
        "diagonal": [[i + 1 if i == j else 0 for j in range(n)] for i in range(n)],
    }


def _gather_case(cid: str, group: str, sizes: list[int], dtype: torch.dtype, rest: tuple[int, ...],
                 salt: int, transposed: bool = False) -> Case:
    def make(rank: int, ws: int) -> torch.Tensor:
        n = sizes[members(group, rank, ws).index(rank)]
        if transposed:  # non-contiguous [n, rest0]
            return tagged(rank, rest[0], (n,), dtype, salt).t()
        return tagged(rank, n, rest, dtype, salt)

    def run(ctx: Ctx) -> Any:
        x = make(ctx.rank, ctx.world_size).to(ctx.device)
        return {"out": all_gatherv(x, sizes, ctx.group(group), group),
                "ref": ref_all_gatherv(x, sizes, ctx.group(group))}

    def expect(rank: int, ws: int) -> Any:
        out = torch.cat([make(m, ws) for m in members(group, rank, ws)])
        return {"out": out, "ref": out}

    return Case(cid, run, expect)


def _reduce_case(cid: str, group: str, sizes: list[int], dtype: torch.dtype, rest: tuple[int, ...],
                 salt: int) -> Case:
    def run(ctx: Ctx) -> Any:
        x = tagged(ctx.rank, sum(sizes), rest, dtype, salt).to(ctx.device)
        return {"out": reduce_scatterv(x, sizes, ctx.group(group), group),
                "ref": ref_reduce_scatterv(x, sizes, ctx.group(group))}

    def expect(rank: int, ws: int) -> Any:
        group_ranks = members(group, rank, ws)
        me = group_ranks.index(rank)
        out = sum_in_rank_order([blocks(tagged(m, sum(sizes), rest, dtype, salt), sizes)[me] for m in group_ranks],
                                dtype)
        return {"out": out, "ref": out}

    return Case(cid, run, expect)


def _a2a_case(cid: str, group: str, matrix: list[list[int]], dtype: torch.dtype, rest: tuple[int, ...],
              salt: int, learn_counts: bool = False) -> Case:
    """Group rank i sends ``matrix[i][j]`` rows to group rank j."""

    def run(ctx: Ctx) -> Any:
        me = members(group, ctx.rank, ctx.world_size).index(ctx.rank)
        send = matrix[me]
        x = tagged(ctx.rank, sum(send), rest, dtype, salt).to(ctx.device)
        if learn_counts:  # the all2all backend's pattern: learn recv sizes, then move the rows
            counts = torch.tensor(send, dtype=torch.int64, device=ctx.device)
            recv = exchange_counts(counts, ctx.group(group), group_name=group).tolist()
        else:
            recv = [row[me] for row in matrix]
        return {"recv": recv, "out": all_to_allv(x, send, recv, ctx.group(group), group),
                "ref": ref_all_to_allv(x, send, recv, ctx.group(group))}

    def expect(rank: int, ws: int) -> Any:
        group_ranks = members(group, rank, ws)
        me = group_ranks.index(rank)
        parts = [blocks(tagged(m, sum(matrix[i]), rest, dtype, salt), matrix[i])[me] for i, m in enumerate(group_ranks)]
        out = torch.cat(parts)
        return {"recv": [row[me] for row in matrix], "out": out, "ref": out}

    return Case(cid, run, expect)


def collective_cases(ws: int) -> list[Case]:
    cases: list[Case] = []
    salt = iter(range(1, 10_000))
    groups = ["world"] + (["tp", "dp"] if ws >= 4 else [])
    for name, sizes in size_patterns(ws).items():
        cases.append(_gather_case(f"all_gatherv-world-{name}-float32", "world", sizes, torch.float32, (3,), next(salt)))
        cases.append(_reduce_case(f"reduce_scatterv-world-{name}-float32", "world", sizes, torch.float32, (3,), next(salt)))
    uneven = size_patterns(ws)["uneven"]
    for dtype, rest in ((torch.bfloat16, (5,)), (torch.float16, (1,)), (torch.int64, ()),
                        (torch.float8_e4m3fn, (4,)), (torch.float8_e5m2, (2, 3)), (torch.float4_e2m1fn_x2, (8,))):
        tag = str(dtype).removeprefix("torch.")
        cases.append(_gather_case(f"all_gatherv-world-uneven-{tag}", "world", uneven, dtype, rest, next(salt)))
    cases.append(_gather_case("all_gatherv-world-uneven-noncontiguous", "world", uneven, torch.float32, (3,),
                              next(salt), transposed=True))
    cases.append(_gather_case("all_gatherv-world-uneven-emptyrow", "world", uneven, torch.float32, (0,), next(salt)))
    for dtype, rest in ((torch.bfloat16, (5,)), (torch.int64, ()), (torch.float32, (2, 2))):
        tag = str(dtype).removeprefix("torch.")
        cases.append(_reduce_case(f"reduce_scatterv-world-uneven-{tag}-{len(rest)}d", "world", uneven, dtype, rest,
                                  next(salt)))
    for name, matrix in send_matrices(ws).items():
        cases.append(_a2a_case(f"all_to_allv-world-{name}-float32", "world", matrix, torch.float32, (3,), next(salt)))
    rand = send_matrices(ws)["random"]
    for dtype, rest in ((torch.bfloat16, (5,)), (torch.int32, ()), (torch.bool, (3,)), (torch.float8_e4m3fn, (4,)),
                        (torch.float8_e5m2, (3,)), (torch.float8_e8m0fnu, (2,))):
        tag = str(dtype).removeprefix("torch.")
        cases.append(_a2a_case(f"all_to_allv-world-random-{tag}", "world", rand, dtype, rest, next(salt)))
    cases.append(_a2a_case("all_to_allv-world-random-exchange_counts", "world", rand, torch.float32, (3,),
                           next(salt), learn_counts=True))
    for group in groups[1:]:
        n = len(members(group, 0, ws))
        cases.append(_gather_case(f"all_gatherv-{group}-uneven-float32", group, size_patterns(n)["uneven"],
                                  torch.float32, (3,), next(salt)))
        cases.append(_reduce_case(f"reduce_scatterv-{group}-first_empty-float32", group,
                                  size_patterns(n)["first_empty"], torch.float32, (3,), next(salt)))
        cases.append(_a2a_case(f"all_to_allv-{group}-random-float8_e4m3fn", group, send_matrices(n)["random"],
                               torch.float8_e4m3fn, (4,), next(salt), learn_counts=True))

    cases.append(Case("exchange_sizes-world", lambda ctx: exchange_sizes(3 * ctx.rank + ctx.rank % 2, None, ctx.device),
                      lambda rank, ws: [3 * r + r % 2 for r in range(ws)]))
    cases.append(Case("exchange_sizes-world-zero", lambda ctx: exchange_sizes(0, None, ctx.device),
                      lambda rank, ws: [0] * ws))
    cases.append(Case("exchange_counts-world",
                      lambda ctx: exchange_counts(torch.tensor(rand[ctx.rank], dtype=torch.int64, device=ctx.device), None),
                      lambda rank, ws: torch.tensor([row[rank] for row in rand], dtype=torch.int64)))
    return cases


def _error(ctx: Ctx, fn: Callable[[], Any], only_rank: int | None = None) -> Any:
    """Calls ``fn`` on every rank, or on ``only_rank`` alone (the others call nothing, so a
    collective started before the check would hang rather than pass)."""
    if only_rank is None or ctx.rank == only_rank:
        return fn()
    return None


def error_cases(ws: int) -> list[Case]:
    # The world group stands in for the named groups: group_name is only the label the message
    # must carry.
    last = ws - 1
    uneven = size_patterns(ws)["uneven"]
    bad_rs = [4, 5] + [0] * (ws - 2)
    rand = send_matrices(ws)["random"]
    cases = [
        Case("error-all_gatherv-sizes-length",
             lambda ctx: _error(ctx, lambda: all_gatherv(ctx.zeros(1, 2), [1] * (ws + 1), None, "ep")),
             raises=lambda rank, ws: ("CollectiveSizeError", [f"all_gatherv on group 'ep' (rank {rank})",
                                                              f"{ws + 1} entries", f"{ws} ranks"])),
        Case("error-all_gatherv-rows-every-rank",
             lambda ctx: _error(ctx, lambda: all_gatherv(ctx.zeros(uneven[ctx.rank] + 1, 2), uneven, None, "tp")),
             raises=lambda rank, ws: ("CollectiveSizeError", [f"all_gatherv on group 'tp' (rank {rank})",
                                                              f"input has {uneven[rank] + 1} rows",
                                                              f"is {uneven[rank]}", str(uneven)])),
        Case("error-all_gatherv-rows-one-rank",
             lambda ctx: _error(ctx, lambda: all_gatherv(ctx.zeros(uneven[last] + 2, 2), uneven, None, "tp"), last),
             raises=lambda rank, ws: ("CollectiveSizeError", [f"(rank {rank})", f"input has {uneven[last] + 2} rows"])
             if rank == last else None),
        Case("error-reduce_scatterv-rows-every-rank",
             lambda ctx: _error(ctx, lambda: reduce_scatterv(ctx.zeros(10, 3), bad_rs, None, "ep")),
             raises=lambda rank, ws: ("CollectiveSizeError", [
                 f"reduce_scatterv on group 'ep' (rank {rank}): input has 10 rows but sizes {bad_rs} sum to 9"])),
        Case("error-reduce_scatterv-rows-one-rank",
             lambda ctx: _error(ctx, lambda: reduce_scatterv(ctx.zeros(10, 3), bad_rs, None, "ep"), last),
             raises=lambda rank, ws: ("CollectiveSizeError", [f"(rank {rank}): input has 10 rows"])
             if rank == last else None),
        Case("error-reduce_scatterv-float8",
             lambda ctx: _error(ctx, lambda: reduce_scatterv(ctx.zeros(ws, 2).to(torch.float8_e4m3fn), [1] * ws,
                                                             None, "ep")),
             raises=lambda rank, ws: ("CollectiveInputError", [f"(rank {rank})", "cannot sum dtype torch.float8_e4m3fn"])),
        Case("error-all_to_allv-negative-one-rank",
             lambda ctx: _error(ctx, lambda: all_to_allv(ctx.zeros(1, 2), [2, -1] + [0] * (ws - 2), [0] * ws, None,
                                                         "ep"), last),
             raises=lambda rank, ws: ("CollectiveSizeError", [f"all_to_allv on group 'ep' (rank {rank})",
                                                              "send_sizes must be >= 0", "-1"])
             if rank == last else None),
        Case("error-all_to_allv-float-size",
             lambda ctx: _error(ctx, lambda: all_to_allv(ctx.zeros(1, 2), [1] + [0] * (ws - 1),
                                                         [1.5] + [0] * (ws - 1), None, "ep")),
             raises=lambda rank, ws: ("CollectiveSizeError", [f"(rank {rank})", "recv_sizes must hold ints", "1.5"])),
        Case("error-all_to_allv-rows",
             lambda ctx: _error(ctx, lambda: all_to_allv(ctx.zeros(sum(rand[ctx.rank]) + 1, 2), rand[ctx.rank],
                                                         [row[ctx.rank] for row in rand], None, "ep")),
             raises=lambda rank, ws: ("CollectiveSizeError", [f"(rank {rank})", f"input has {sum(rand[rank]) + 1} rows",
                                                              f"send_sizes {rand[rank]} sum to {sum(rand[rank])}"])),
        Case("error-all_gatherv-meta-device",
             lambda ctx: _error(ctx, lambda: all_gatherv(torch.zeros(1, 2, device="meta"), [1] * ws, None, "tp")),
             raises=lambda rank, ws: ("CollectiveInputError", [f"(rank {rank})", "input is on meta", "needs"])),
        Case("error-exchange_counts-dtype",
             lambda ctx: _error(ctx, lambda: exchange_counts(ctx.zeros(ws, dtype=torch.int32), None, group_name="ep")),
             raises=lambda rank, ws: ("CollectiveInputError", [f"exchange_counts on group 'ep' (rank {rank})",
                                                               "int64", "int32"])),
        Case("error-exchange_counts-length-one-rank",
             lambda ctx: _error(ctx, lambda: exchange_counts(ctx.zeros(ws + 1, dtype=torch.int64), None,
                                                             group_name="ep"), last),
             raises=lambda rank, ws: ("CollectiveSizeError", [f"(rank {rank})", f"shape [{ws + 1}]", f"{ws} ranks"])
             if rank == last else None),
        Case("error-exchange_sizes-negative",
             lambda ctx: _error(ctx, lambda: exchange_sizes(-1, None, ctx.device, group_name="ep")),
             raises=lambda rank, ws: ("CollectiveSizeError", [f"(rank {rank})", "n must be an int >= 0", "-1"])),
        Case("error-sequence_parallel_gather-rows-one-rank", lambda ctx: _error(ctx, lambda: _bad_gather(ctx), last),
             raises=lambda rank, ws: ("CollectiveSizeError", [f"sequence_parallel_gather on group 'tp' (rank {rank})",
                                                              "y has 3 rows", "2 real rows"])
             if rank == last else None),
        Case("error-groups-world-size",
             lambda ctx: ParallelGroups.build(ParallelConfig(dp=ws + 1, tp=1)),
             raises=lambda rank, ws: ("ValueError", [f"(rank {rank})", f"world size {ws}",
                                                     f"dp*tp = {ws + 1}*1 = {ws + 1}"])),
    ]
    return cases


def _bad_gather(ctx: Ctx) -> Any:
    # T = 2 * world_size: every rank's chunk has 2 real rows; hand in 3.
    x = tagged(0, 2 * ctx.world_size, (2,), torch.float32)
    _, chunk = sequence_parallel_chunk(x, ctx.rank, ctx.world_size)
    return sequence_parallel_gather(ctx.zeros(3, 2), chunk, None)


# ----------------------------------------------------------------------------- sequence parallel

def expected_chunk(total: int, tp_rank: int, tp: int) -> dict[str, int]:
    """The chunk by counting: pad with rows until divisible, hand out consecutive slices."""
    padded = total
    while padded % tp:
        padded += 1
    chunk = padded // tp
    rows = [i for i in range(total) if tp_rank * chunk <= i < (tp_rank + 1) * chunk]
    return {"total": total, "padded": padded, "chunk": chunk, "start": tp_rank * chunk, "real": len(rows),
            "tp_rank": tp_rank, "tp": tp}


def _sp_layout(name: str, rank: int, ws: int) -> tuple[int, int, int]:
    """(tp_rank, tp, dp_index) of rank for the TP group "world" or the sub layout's "tp"."""
    if name == "world":
        return rank, ws, 0
    cfg = sub_config(ws)
    return cfg.tp_rank(rank), cfg.tp, cfg.dp_rank(rank)


def _sp_input(dp_index: int, total: int, dtype: torch.dtype) -> torch.Tensor:
    # Different tokens on each DP rank, identical on the TP ranks of one DP rank.
    return tagged(dp_index, total, (3,), dtype, salt=total)


def _sp_fn(x: torch.Tensor) -> torch.Tensor:
    # A row-wise stand-in for the layer: a misplaced row changes the output.
    return x if is_byte_float(x.dtype) else x * 2 + 1


def _sequence_case(group: str, tp: int, total: int, dtype: torch.dtype) -> Case:
    def run(ctx: Ctx) -> Any:
        tp_rank, tp, dp_index = _sp_layout(group, ctx.rank, ctx.world_size)
        x = _sp_input(dp_index, total, dtype).to(ctx.device)
        x_chunk, chunk = sequence_parallel_chunk(x, tp_rank, tp)
        out = sequence_parallel_gather(_sp_fn(x_chunk), chunk, ctx.group(group))
        return {"chunk": asdict(chunk), "x_chunk": x_chunk, "out": out}

    def expect(rank: int, ws: int) -> Any:
        tp_rank, tp, dp_index = _sp_layout(group, rank, ws)
        x = _sp_input(dp_index, total, dtype)
        want = expected_chunk(total, tp_rank, tp)
        return {"chunk": want, "x_chunk": x[want["start"]:want["start"] + want["real"]], "out": _sp_fn(x)}

    tag = str(dtype).removeprefix("torch.")
    return Case(f"sequence-{group}-tp{tp}-T{total}-{tag}", run, expect)


def sequence_cases(ws: int) -> list[Case]:
    cases = []
    for group in ["world"] + (["tp"] if ws >= 4 else []):
        tp = len(members(group, 0, ws))
        for total in sorted({0, 1, tp - 1, tp, tp + 1, 7, 64}):
            cases.append(_sequence_case(group, tp, total, torch.float32))
        cases.append(_sequence_case(group, tp, tp + 1, torch.float8_e4m3fn))
        cases.append(_sequence_case(group, tp, 7, torch.bfloat16))
    return cases


# ----------------------------------------------------------------------------- groups

# (dp, tp, enable_ep) per world size; every one is built with side_channel=True.
LAYOUTS = {
    2: [(1, 2, False), (2, 1, True), (2, 1, False)],
    4: [(2, 2, True), (2, 2, False), (1, 4, True), (4, 1, True), (1, 4, False)],
    8: [(2, 4, True), (4, 2, False), (8, 1, True)],
}
NUM_EXPERTS = 16


def _layout_case(dp: int, tp: int, ep: bool) -> Case:
    cfg = ParallelConfig(dp, tp, ep)

    def run(ctx: Ctx) -> Any:
        g = ParallelGroups.build(cfg, side_channel=True)
        # Each member reports its global rank over the group: proves the group objects connect
        # exactly the ranks the lists name, in that order.
        def over(group: Any, name: str, device: torch.device = g.device) -> list[int] | None:
            return exchange_sizes(ctx.rank, group, device, group_name=name) if group else None

        return {"rank": g.rank, "world_size": g.world_size, "tp_ranks": g.tp_ranks, "dp_ranks": g.dp_ranks,
                "ep_ranks": g.ep_ranks, "index": {n: g.index_in(n) for n in GROUP_NAMES}, "device_ok": g.device == ctx.device,
                "tp_members": over(g.tp_group, "tp"), "dp_members": over(g.dp_group, "dp"),
                "ep_members": over(g.ep_group, "ep"), "side_members": over(g.side_group, "side", torch.device("cpu")),
                "side_backend": str(dist.get_backend(g.side_group)) if g.side_group else None,
                "local_experts": list(g.config.local_experts(g.rank, NUM_EXPERTS))}

    def expect(rank: int, ws: int) -> Any:
        d, t = rank // tp, rank % tp
        tp_ranks = [d * tp + i for i in range(tp)]
        dp_ranks = [i * tp + t for i in range(dp)]
        ep_ranks = list(range(ws)) if ep else [rank]
        per = NUM_EXPERTS // (ws if ep else 1)
        first = rank * per if ep else 0
        return {"rank": rank, "world_size": ws, "tp_ranks": tp_ranks, "dp_ranks": dp_ranks, "ep_ranks": ep_ranks,
                "index": {"tp": t, "dp": d, "ep": rank if ep else 0}, "device_ok": True,
                "tp_members": tp_ranks, "dp_members": dp_ranks, "ep_members": ep_ranks if ep else None,
                "side_members": ep_ranks if ep else None, "side_backend": "gloo" if ep else None,
                "local_experts": list(range(first, first + per))}

    return Case(f"groups-{cfg.name}", run, expect)


# ----------------------------------------------------------------------------- running

def build_cases(ws: int) -> list[Case]:
    cases = (collective_cases(ws) + error_cases(ws) + sequence_cases(ws)
             + [_layout_case(*layout) for layout in LAYOUTS.get(ws, [])])
    ids = [c.id for c in cases]
    duplicates = sorted({i for i in ids if ids.count(i) > 1})
    if duplicates:
        raise AssertionError(f"duplicate case ids: {duplicates}")
    return cases


def run_cases(ws: int) -> dict[str, dict[str, Any]]:
    """Worker entry for ``spawn``: every case on this rank; case id -> record.

    A record is ``{"ok": True, "value": ...}`` or ``{"ok": False, "type": ..., "message": ...,
    "traceback": ...}``.  After each case all ranks meet in a barrier, so a case that failed on
    some ranks does not shift the next case's collectives.  Tensors live on cuda under NCCL.
    """
    rank = dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    cfg = sub_config(ws)
    ctx = Ctx(rank, ws, device, ParallelGroups.build(cfg) if cfg else None)
    records = {}
    for case in build_cases(ws):
        try:
            records[case.id] = {"ok": True, "value": case.run(ctx)}
        except Exception as exc:  # noqa: BLE001 - recorded, asserted on in the parent
            records[case.id] = {"ok": False, "type": type(exc).__name__, "message": str(exc),
                                "traceback": traceback.format_exc()}
        dist.barrier()
    return records


# ----------------------------------------------------------------------------- checking

def assert_same(actual: Any, expected: Any, where: str = "value") -> None:
    """Exact (bitwise for tensors) equality of nested dicts/lists/tensors, with a useful message."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"{where}: expected a tensor, got {type(actual).__name__}"
        assert actual.dtype == expected.dtype, f"{where}: dtype {actual.dtype} != {expected.dtype}"
        assert tuple(actual.shape) == tuple(expected.shape), \
            f"{where}: shape {list(actual.shape)} != {list(expected.shape)}"
        a = actual.contiguous().reshape(-1).view(torch.uint8)
        e = expected.contiguous().reshape(-1).view(torch.uint8)
        if not torch.equal(a, e):
            rows = [i for i in range(actual.shape[0]) if not torch.equal(
                actual[i].contiguous().reshape(-1).view(torch.uint8),
                expected[i].contiguous().reshape(-1).view(torch.uint8))] if actual.dim() else []
            raise AssertionError(f"{where}: rows {rows[:10]} differ; first: got {actual[rows[0]] if rows else actual}, "
                                 f"want {expected[rows[0]] if rows else expected}")
    elif isinstance(expected, dict):
        assert isinstance(actual, dict) and actual.keys() == expected.keys(), \
            f"{where}: keys {sorted(actual) if isinstance(actual, dict) else actual} != {sorted(expected)}"
        for key in expected:
            assert_same(actual[key], expected[key], f"{where}[{key!r}]")
    else:
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


def check(case: Case, rank: int, ws: int, record: dict[str, Any]) -> None:
    """Asserts that ``record`` (from rank ``rank``) is what ``case`` wants on that rank."""
    raises = case.raises(rank, ws)
    if raises is not None:
        type_name, fragments = raises
        assert not record["ok"], f"rank {rank}: expected {type_name}, got value {record.get('value')!r}"
        assert record["type"] == type_name, f"rank {rank}: raised {record['type']}, wanted {type_name}:\n" \
                                            f"{record['traceback']}"
        for fragment in fragments:
            assert fragment in record["message"], f"rank {rank}: {fragment!r} not in message {record['message']!r}"
        return
    assert record["ok"], f"rank {rank} raised {record['type']}: {record['message']}\n{record['traceback']}"
    assert_same(record["value"], case.expect(rank, ws), f"rank {rank}")
