"""``scripts/decode_study.py``'s reader, the floor its one-token experts are measured against: every
variant of its sweep reads each element of the buffer exactly once (the checksums add up to the
buffer's sum, wrapping as int32 does), so a fast variant cannot be one that skipped bytes. Run
through Triton's interpreter; the timing itself needs a GPU (the study runs on the GPU machine)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import decode_study  # noqa: E402


def _wrapped_sum(t: torch.Tensor) -> int:
    """The int32 sum of ``t`` as the kernel's int32 additions give it (modulo 2^32, signed)."""
    total = int(t.to(torch.int64).sum()) % 2**32
    return total - 2**32 if total >= 2**31 else total


@pytest.mark.parametrize("n, programs, block", [
    (100_003, 3, 2048),    # a partial last chunk, a partial last step
    (4096 * 7, 7, 4096),   # whole chunks
    (5, 16, 2048),         # fewer elements than one step: one program
    (65_536, 1, 8192),     # one program, many steps
])
def test_every_element_is_read_once(n, programs, block):
    src = torch.randint(-2**31, 2**31 - 1, (n,), dtype=torch.int32, generator=torch.Generator().manual_seed(n))
    call, sums = decode_study.read_stream(src, programs, block)
    call()
    assert 1 <= sums.numel() <= programs
    assert _wrapped_sum(sums) == _wrapped_sum(src)


def test_the_sweep_covers_grids_and_widths():
    per_sm = {p for p, _ in decode_study.READ_SWEEP}
    blocks = {b for _, b in decode_study.READ_SWEEP}
    assert per_sm == {1, 2, 4, 8, 16} and blocks == {2048, 4096, 8192}


def test_a_reader_that_skips_an_element_is_caught():
    """Planted fault: the same launch told the buffer is one element shorter."""
    src = torch.randint(1, 1000, (10_000,), dtype=torch.int32, generator=torch.Generator().manual_seed(1))
    sums = torch.empty(1, dtype=torch.int32)
    decode_study._read_kernel[(1,)](src, sums, src.numel() - 1, CHUNK=10_240, BLOCK=2048, num_warps=8)
    assert _wrapped_sum(sums) != _wrapped_sum(src)


def test_each_gemms_share_is_read_once():
    """The study reads the gate_up GEMM's bytes and the down GEMM's alone as two views of one
    buffer, the second starting inside it: together they read every element once."""
    src = torch.randint(-2**31, 2**31 - 1, (30_011,), dtype=torch.int32, generator=torch.Generator().manual_seed(2))
    split = 20_007
    parts = []
    for view in (src[:split], src[split:]):
        call, sums = decode_study.read_stream(view, 4, 2048)
        call()
        assert _wrapped_sum(sums) == _wrapped_sum(view)
        parts.append(_wrapped_sum(sums))
    assert _wrapped_sum(torch.tensor(parts)) == _wrapped_sum(src)


def test_a_projections_bytes_count_its_scales():
    """Hand-counted: fp8_token [2, 6, 4] values (48 bytes) and one fp32 scale per expert and row
    (2 x 6 x 4 bytes); fp8_tensor [2, 4, 3] values (24 bytes) and one fp32 scale per expert (8); a
    bf16 [2, 6, 4] tensor 96. The two GEMMs' shares add up to what one expert reads, times E."""
    from moeshard.bench.workload import bytes_per_expert, projection_bytes
    from moeshard.experts.base import ExpertWeights
    from moeshard.quant import quantize_weight

    gate_up = quantize_weight(torch.randn(2, 6, 4), "fp8_token")
    down = quantize_weight(torch.randn(2, 4, 3), "fp8_token")
    assert projection_bytes(gate_up) == 48 + 48
    assert projection_bytes(quantize_weight(torch.randn(2, 4, 3), "fp8_tensor")) == 24 + 8
    assert projection_bytes(torch.zeros(2, 6, 4, dtype=torch.bfloat16)) == 96
    experts = ExpertWeights(gate_up=gate_up, down=down, scheme="fp8_token")
    assert bytes_per_expert(experts) == (projection_bytes(gate_up) + projection_bytes(down)) / 2 == (96 + 56) / 2


@pytest.mark.parametrize("scheme", [pytest.param("fp8_tensor", marks=pytest.mark.slow), "fp8_block"])
def test_the_gemv_stages_are_the_experts_call_on_the_gemvs(interpreted_kernels, exact_interpreter, scheme):
    """``--gemv``: the two stages timed alone, run one after the other, give the bits the experts'
    call on the same GEMVs gives, so the stages are the call's kernels and not something cheaper."""
    import dataclasses

    from moeshard.bench.workload import make_model

    k = interpreted_kernels
    gemv = k.configs.GemvConfig(16, 16, 128, 4)
    call = decode_study.Call(make_model("mixtral-8x7b", torch.device("cpu"), size="small"), 1, scheme, gemv)
    assert call.gemv == gemv  # the one given, whatever the selected config takes
    call.gemv_gate_up()
    y = call.gemv_down().clone()
    config = dataclasses.replace(call.sel, gemv=gemv, quantize_in_down=False)
    want = k.experts.TritonExperts(call.cfg.activation, call.cfg.dtype, config)(call.inp, call.experts)
    assert torch.equal(y, want) and y.abs().sum() > 0, scheme
