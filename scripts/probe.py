"""Capability probes on the GPU machine: what this torch / Triton build accepts for our layouts.

    PYTHONPATH=src python3 scripts/probe.py > probe.json

Each probe runs a tiny problem and compares with a dequantized fp32 product; failures are
recorded with their error, never raised.
"""

from __future__ import annotations

import json
import subprocess

import torch


def _try(fn):
    try:
        return {"ok": True, **(fn() or {})}
    except Exception as exc:  # a probe records whatever the build says
        return {"ok": False, "error": f"{type(exc).__name__}: {str(exc)[:400]}"}


def scaled_grouped_mm_rowwise():
    from moeshard.quant import quantize_activations, quantize_weight
    E, M, N, K = 4, 256, 384, 512
    x = torch.randn(M, K, device="cuda")
    w = torch.randn(E, N, K, device="cuda") / K**0.5
    xq, wq = quantize_activations(x, "fp8_token"), quantize_weight(w, "fp8_token")
    offs = torch.tensor([64, 64, 200, 256], dtype=torch.int32, device="cuda")
    out = torch._scaled_grouped_mm(xq.data, wq.data.transpose(-2, -1), xq.row_scale.reshape(-1), wq.scale, offs=offs,
                                   out_dtype=torch.bfloat16)
    ref = torch.empty(M, N, device="cuda")
    xd, wd = xq.dequantize(), wq.dequantize()
    start = 0
    for e, end in enumerate(offs.tolist()):
        ref[start:end] = xd[start:end] @ wd[e].T
        start = end
    return {"max_rel_err": float((out.float() - ref).abs().max() / ref.abs().max())}


def scaled_grouped_mm_blockwise():
    from moeshard.quant import quantize_activations, quantize_weight
    E, M, N, K = 2, 256, 256, 512
    xq = quantize_activations(torch.randn(M, K, device="cuda"), "fp8_block")
    wq = quantize_weight(torch.randn(E, N, K, device="cuda"), "fp8_block")
    offs = torch.tensor([128, 256], dtype=torch.int32, device="cuda")
    torch._scaled_grouped_mm(xq.data, wq.data.transpose(-2, -1), xq.row_scale, wq.scale, offs=offs,
                             out_dtype=torch.bfloat16)
    return {}


def grouped_mm_bf16():
    a = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(4, 384, 512, device="cuda", dtype=torch.bfloat16)
    offs = torch.tensor([64, 64, 200, 256], dtype=torch.int32, device="cuda")
    torch._grouped_mm(a, b.transpose(-2, -1), offs=offs)
    return {}


def triton_tensor_descriptor():
    import triton
    from triton.tools.tensor_descriptor import TensorDescriptor
    TensorDescriptor.from_tensor(torch.empty(256, 256, device="cuda", dtype=torch.bfloat16), [64, 64])
    return {"triton": triton.__version__}


def main() -> None:
    props = torch.cuda.get_device_properties(0)
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.limit",
                          "--format=csv"], capture_output=True, text=True).stdout
    out = {
        "device": props.name, "capability": f"{props.major}.{props.minor}", "sms": props.multi_processor_count,
        "l2_bytes": getattr(props, "L2_cache_size", None), "torch": torch.__version__, "cuda": torch.version.cuda,
        "nvidia_smi": smi,
        "has_float4_e2m1fn_x2": hasattr(torch, "float4_e2m1fn_x2"),
        "has_scaled_grouped_mm": hasattr(torch, "_scaled_grouped_mm"),
        "grouped_mm_bf16": _try(grouped_mm_bf16),
        "scaled_grouped_mm_rowwise_fp8": _try(scaled_grouped_mm_rowwise),
        "scaled_grouped_mm_blockwise_fp8": _try(scaled_grouped_mm_blockwise),
        "triton_tensor_descriptor": _try(triton_tensor_descriptor),
    }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
