"""Whether two codes run the same grouped-GEMM and combine kernels on one GPU, without a GPU.

    python scripts/sass_diff.py --base-src DIR [--new-src .] [--gpu h200] [--out FILE]

For each shape the fp8 target benches time (``moeshard bench``'s three models at 1, 16, 128,
4096 and 16384 tokens; bf16, fp8_tensor, fp8_token, fp8_block), each code's own
``select_config`` chooses the experts' tiles on ``--gpu``'s table with 132 multiprocessors; the
two choices must be equal. Then every Triton GEMM variant those choices launch
(``moe_gemm_kernel``: gate_up and down, with the half tiles, the row maxima, h quantized in
gate_up, programmatic dependent launch as chosen) is compiled for Hopper (sm_90a) by each code's
own ``scripts/kernel_resources.compile_gemm``, and so is the layer's top-k combine
(``dispatch/combine_kernel.py``: each model's top-k, the fp32 sum and the final bf16 one with the
shared experts' addend). Their SASS (``cuobjdump --dump-sass``) is compared: the same opcodes in
the same order, or the same opcodes with a few in another order (a kernel argument added shifts
the parameters' constant-bank offsets, and the scheduler may then order a few uniform loads
differently), or different instructions. Each code runs in its own process with ``sys.path`` at
its ``src`` and ``scripts`` (``git archive BASE src scripts | tar -x -C DIR`` makes a base tree).
The Gluon GEMMs (``engine="gluon"``) are not compiled here: the choices name them, and their
kernels' source is compared by the caller (git diff).

Use: a change that is not meant to move the timed kernels shows the same choices and the same
instructions, so the last GPU measurements stand for it. The installed Triton compiles both
codes; it may be newer than the GPU machine's, whose compiler could differ in the same way for
both. Exit code 0 when every choice and every kernel's opcodes are the same, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

MODELS = {"mixtral-8x7b": (8, 4096, 14336, 2), "qwen3-30b-a3b": (128, 2048, 768, 8),
          "deepseek-v3": (256, 7168, 2048, 8)}  # (E, H, I, top-k)
TOKENS = (1, 16, 128, 4096, 16384)
SCHEMES = ("none", "fp8_tensor", "fp8_token", "fp8_block")
MODES = {"none": 0, "fp8_tensor": 1, "fp8_token": 2, "fp8_block": 3}

# Runs inside each code's process: prints {"configs": {case: repr}, "sass": {variant: [opcodes]}}.
_CHILD = r'''
import dataclasses, inspect, json, re, sys
tree = sys.argv[1]
sys.path[:0] = [tree + "/src", tree + "/scripts"]
import kernel_resources as kr
from moeshard.kernels import configs
models, tokens, schemes, modes, gpu = json.loads(sys.argv[2])
takes_gpu = "gpu" in inspect.signature(configs.select_config).parameters
chosen, variants = {}, {}
for model, (E, H, I, K) in models.items():
    for T in tokens:
        for scheme in schemes:
            M = T * K
            extra = {"gpu": gpu} if takes_gpu else {}
            cfg = configs.select_config(M, E, H, I, scheme, 132, "mma", pdl=True, gluon=True, **extra)
            chosen[f"{model} T={T} {scheme}"] = repr(cfg)
            q = modes[scheme]
            elt = "bf16" if q == 0 else "fp8e4nv"
            for fused, g in ((True, cfg.gate_up), (False, cfg.down)):
                if g.engine != "triton":
                    continue
                opts = {"half_tiles": g.half_tiles, "pdl": cfg.pdl == "all" or (fused and cfg.pdl != "off"),
                        "direct": cfg.direct and T == 1}  # one token's rows: the direct plan
                # ... where the down GEMM may quantize h as it loads it (codes that have the option)
                in_down = getattr(cfg, "quantize_in_down", False) and T == 1 and q in (1, 2, 3)
                if in_down and not fused:
                    opts["quant_a"] = True
                if fused:
                    opts["quant_out"] = cfg.h_quant == "gate_up" and not in_down
                    opts["track_amax"] = 2 if cfg.h_quant == "row_max" else (1 if scheme == "fp8_tensor" else 0)
                tile = (g.block_m, g.block_n, g.block_k, g.num_warps, g.num_stages)
                key = f"{elt} {'gate_up' if fused else 'down'} {tile} {g.fp8_acc} {sorted(opts.items())}"
                if key not in variants:
                    variants[key] = (q, elt, fused, tile, g.fp8_acc, opts)
sass = {}
for key, (q, elt, fused, tile, acc, opts) in variants.items():
    kernel = kr.compile_gemm(q, elt, fused, tile, acc, **opts)
    text = kr.cuobjdump(kernel, "--dump-sass")
    sass[key] = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", text)
# The layer's top-k combine (dispatch/combine_kernel.py), as the local backend launches it: the
# fp32 sum, and the final combine that adds the shared experts and rounds to bf16. A code whose
# kernel takes the pairs' ids (empty picks) runs it here without them (SKIP off), as for any
# routing that holds none.
import triton
from triton.compiler import ASTSource
from moeshard.dispatch import combine_kernel as ck
names = list(ck._combine_kernel.arg_names)
for K in sorted({m[3] for m in models.values()}):
    for add, out in ((False, "fp32"), (True, "bf16")):
        sig = {"y_ptr": "*bf16", "w_ptr": "*fp32", "rows_ptr": "*fp32", "add_ptr": "*bf16" if add else f"*{out}",
               "out_ptr": f"*{out}", "H": "i32", "stride_y": "i32", "stride_w": "i32", "stride_a": "i32",
               "stride_o": "i32"}
        consts = {"TOP_K": K, "BLOCK_H": ck.BLOCK_H, "GATHER": False, "ADD": add}
        if "ids_ptr" in names:
            sig["ids_ptr"] = "*fp32"
            consts["SKIP"] = False
        sig.update({k: "constexpr" for k in consts})
        aligned = ["y_ptr", "w_ptr", "out_ptr", "add_ptr", "H", "stride_y", "stride_o", "stride_a"]
        attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
        kernel = triton.compile(ASTSource(fn=ck._combine_kernel, signature=sig, constexprs=consts, attrs=attrs),
                                target=kr.SM90, options={"num_warps": 4})
        text = kr.cuobjdump(kernel, "--dump-sass")
        sass[f"combine K={K} add={add} out={out}"] = re.findall(
            r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", text)
print(json.dumps({"configs": chosen, "sass": sass}))
'''


def _compiled(tree: Path, gpu: str, timeout_s: float) -> dict:
    """The tile choices and SASS opcode sequences of the code at ``tree`` (its own process)."""
    args = json.dumps([MODELS, TOKENS, SCHEMES, MODES, gpu])
    # The child's sys.path starts at the tree; nothing of the caller's may come first or switch
    # Triton to its interpreter.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_INTERPRET")}
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(tree), args], capture_output=True, text=True,
                          timeout=timeout_s, env={**env, "TRITON_DEFAULT_FP_FUSION": "1"})
    if proc.returncode != 0:
        raise SystemExit(f"sass_diff: compiling the code at {tree} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.splitlines()[-1])


def compare(base: dict, new: dict) -> tuple[list[str], bool]:
    """Lines of the comparison and whether everything is the same."""
    lines, same = [], True
    for case in base["configs"]:
        if base["configs"][case] != new["configs"].get(case):
            same = False
            lines.append(f"choice differs: {case}\n  base {base['configs'][case]}\n  new  {new['configs'].get(case)}")
    engines = sorted({m for r in base["configs"].values() for m in re.findall(r"engine='(\w+)'", r)})
    lines.append(f"{len(base['configs'])} tile choices compared; engines chosen: {engines}")
    for key in sorted(set(base["sass"]) | set(new["sass"])):
        a, b = base["sass"].get(key), new["sass"].get(key)
        if a is None or b is None:
            verdict = f"compiled by the {'new' if a is None else 'base'} code only (its choices differ above)"
            same = False
        elif a == b:
            verdict = "the same instructions in the same order"
        elif Counter(a) == Counter(b):
            # A kernel argument added or moved shifts the parameters' constant-bank offsets, and the
            # scheduler may then order a few uniform loads differently: the same work.
            verdict = "the same instructions, a few in another order"
        else:
            verdict = f"DIFFERENT: {dict((Counter(a) - Counter(b)) + (Counter(b) - Counter(a)))}"
            same = False
        lines.append(f"{key}: {len(a or [])} / {len(b or [])} instructions, {verdict}")
    return lines, same


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-src", required=True, help="the base code's tree (with src/ and scripts/)")
    p.add_argument("--new-src", default=str(Path(__file__).resolve().parent.parent),
                   help="the new code's tree (default: this repository)")
    p.add_argument("--gpu", default="h200", help="select_config's GPU table (default h200)")
    p.add_argument("--out", default=None, help="also write the comparison to this file")
    p.add_argument("--timeout-s", type=float, default=1200.0)
    args = p.parse_args(argv)
    trees = [Path(args.base_src).resolve(), Path(args.new_src).resolve()]
    for tree in trees:
        if not (tree / "src" / "moeshard").is_dir() or not (tree / "scripts" / "kernel_resources.py").is_file():
            print(f"sass_diff: {tree} has no src/moeshard or scripts/kernel_resources.py", file=sys.stderr)
            return 2
    base, new = (_compiled(tree, args.gpu, args.timeout_s) for tree in trees)
    lines, same = compare(base, new)
    text = "\n".join([f"# base {trees[0]}, new {trees[1]}, gpu table {args.gpu}", *lines,
                      "same choices and instructions" if same else "the codes differ"]) + "\n"
    print(text, end="")
    if args.out:
        Path(args.out).write_text(text)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
