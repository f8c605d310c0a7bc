"""Started by torchrun (see test_torchrun.py): joins the world through env:// and runs a few
verification cases with the user's own rendezvous, as a user beyond one machine would."""

import json
import sys

import torch

from moeshard.harness.cases import MatrixOptions, generate
from moeshard.harness.execute import GroupsCache, run_case
from moeshard.parallel.config import ParallelConfig
from moeshard.parallel.torchrun import destroy, init_from_env


def main() -> int:
    device = init_from_env()
    torch.set_num_threads(1)
    rank = torch.distributed.get_rank()
    layouts = tuple(ParallelConfig.parse(t) for t in sys.argv[1].split(";"))
    opts = MatrixOptions(world_sizes=(torch.distributed.get_world_size(),), layouts=layouts,
                         quants=("none", "fp8_block", "nvfp4+defer"), dtypes=("bfloat16",))
    cache = GroupsCache(device.type)
    results = []
    for case in generate(opts):
        if case.skipped or case.parallel not in layouts:
            continue
        r = run_case(case, rank, device, cache.get(case.parallel))
        results.append({"id": case.id, "ok": r.ok, "err": r.max_abs_err, "rows": r.rows})
    # One file per rank: two ranks printing to torchrun's shared stdout can interleave lines.
    with open(f"{sys.argv[2]}/rank{rank}.json", "w") as f:
        json.dump({"rank": rank, "results": results}, f)
    destroy()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
