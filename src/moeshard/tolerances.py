"""The one tolerance table, and the comparison that uses it.

``LAYER[dtype] = (atol, rtol)`` bounds |layer - reference| elementwise as
``atol + rtol * |reference| + slack``, where the reference reproduces the layer's quantization
exactly and prices the roundings the kernel's accumulation may flip and the model-dtype
roundings of the experts' outputs and the shared MLP (its ``slack``, see ``moeshard.reference``).
What remains is the output's own rounding to the model dtype (u: bf16 2^-8, fp16 2^-11), the
order of fp32 sums and rounding differences between devices' elementwise functions, the same
for every quantization scheme: a quantized layer needs no more
room than an unquantized one, so a new scheme needs no entry here. Upstream's loosest figures
(bf16 3.5e-2, fp8 6.5e-2, nvfp4 0.1 + H * 1e-4) are the ceiling; these are tighter.

The quantization error of each scheme against the unquantized layer is bounded separately by
the scheme's descriptor (``QuantScheme.quant_error``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moeshard.numerics import Reference
from moeshard.quant.schemes import get_scheme

LAYER: dict[str, tuple[float, float]] = {
    "float32": (1e-5, 1e-5),
    # bf16 and fp16: 2.6 and 4 times the output's rounding. Largest error / bound at bf16 1e-2:
    # the CPU matrix (`moeshard check`) 0.69 (nvfp4, DeepSeek-V3, TP2 + EP); every preset's
    # layer at 300 tokens and 8 times the usual inputs 0.70 (tests/test_reference.py); one
    # H100's GPU gate 0.35.
    "float16": (2e-3, 2e-3),
    "bfloat16": (1e-2, 1e-2),
}

# A whole model's logits against transformers' (``moeshard generate --compare``): no reference
# prices anything there, and every layer's rounding differences reach the logits (moeshard's
# block sums the experts in fp32 and rounds once, transformers rounds each expert's share), so
# a model's logits get twice the layer table's room at fp16 and bf16. The tiny models' bf16
# logits differ by a bf16 ulp (7.8e-3).
LOGITS: dict[str, tuple[float, float]] = {
    "float32": (1e-5, 1e-5),
    "float16": (4e-3, 4e-3),
    "bfloat16": (2e-2, 2e-2),
}


# Gradients (``moeshard check --backward``): the largest error of a row of a gradient relative to
# that row's largest reference value (at least 10% of the tensor's: ``harness.grads``), against
# the fp64 reference, which rounds the forward's values as the layer does (``training.reference``)
# but not the backward's. Largest seen over the gradient matrix at world sizes 1, 2, 4 and seeds
# 0-3: fp32 1.0e-5 (the router's gradient, through fp32 routing), bf16 2.1e-2 (a shared expert's
# row from one token), 1.2e-2 elsewhere; fp16 (seeds 0-1) 1.6e-3; the norm's relative error
# 1.6e-7, 6.8e-4 and 6.0e-5.
GRAD: dict[str, float] = {
    "float32": 5e-5,
    "float16": 5e-3,
    "bfloat16": 4e-2,
}

# A whole model's training loss (``moeshard train --compare``, fp32): the largest relative
# difference from transformers' own training on one device at any step. Rounding differences
# (another summation order in the MoE blocks, the DP ranks' shares summed) reach later losses
# through every update, and grow with the learning rate and the steps. Largest seen over
# tests/test_train.py (four tiny families, every layout, sgd at lr 0.05 and adamw at 0.01, 3
# steps): 2.9e-7, the gradient norm 9.8e-7; the README's 3.7M-parameter Mixtral, 4 adamw steps
# at lr 1e-4 under SP: 2e-7 (at lr 1e-3, where its loss falls from 13.2 to 0.18: 4.7e-5).
TRAIN_LOSS_RTOL = 1e-4

# Float32 rounding amplified by training. A rounding difference that flips a top-k choice changes
# the gradients by far more than its own size, other layers amplify it too (Mamba's, in the tiny
# models below), and every later step carries it on: two float32 runs of one training, differing
# only in rounding order, can drift apart by far more than TRAIN_LOSS_RTOL. Such a run is judged
# against transformers' float64 run of the same steps, allowing at each step the tolerance plus
# TRAIN_ROUNDING_FACTOR times transformers' own float32 distance from that run (``train_bound``):
# how much rounding this model amplifies by that step, measured. moeshard's float32 run is one
# more rounding order, so its distance from float64 is another sample of the same amplification,
# not bounded by the first one.
# Measured over tests/test_train_families.py (24 tiny families, three SGD steps at lr 0.01, (1,1)
# and EP2): transformers' own float32 third loss up to 1.3e-2 from its float64 one (qwen3_next),
# moeshard's beyond the tolerance by at most 2.3 times transformers' own distance (gpt_oss under
# EP2: 2.1e-4 from float64, where transformers' float32 run is 4.9e-5 from it; a factor of 2
# would reject it), its last gradient norm by at most 1.7 times, its parameters (absolute, over
# the whole model, beyond the test's 5e-4) by at most 1.0 times. A float32 run within
# TRAIN_LOSS_RTOL of transformers' float32 run is within this bound too (the triangle inequality).
TRAIN_ROUNDING_FACTOR = 4.0


def train_bound(tolerance: float, rounding: float) -> float:
    """The largest difference from transformers' float64 training allowed to a float32 training,
    where transformers' own float32 training differs from the float64 one by ``rounding`` (both in
    one measure: relative for a loss or a gradient norm, absolute for parameters) and ``tolerance``
    is what the comparison allows without amplification."""
    return tolerance + TRAIN_ROUNDING_FACTOR * rounding


def grad_tolerance(dtype: torch.dtype | str) -> float:
    """The gradient bound of a model dtype (``GRAD``)."""
    name = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    if name not in GRAD:
        raise ValueError(f"grad_tolerance: no entry for dtype={name!r}; the table has {sorted(GRAD)}")
    return GRAD[name]


def logits_tolerance(dtype: torch.dtype | str) -> tuple[float, float]:
    """(atol, rtol) of a whole model's logits against transformers' in a model dtype (``LOGITS``)."""
    name = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    if name not in LOGITS:
        raise ValueError(f"logits_tolerance: no entry for dtype={name!r}; the table has {sorted(LOGITS)}")
    return LOGITS[name]


def tolerance(dtype: torch.dtype | str, scheme: str) -> tuple[float, float]:
    """(atol, rtol) of a model dtype; ``scheme`` must be a registered scheme."""
    get_scheme(scheme, "tolerance: quant")
    name = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    if name not in LAYER:
        raise ValueError(f"tolerance: no entry for dtype={name!r}; the table has {sorted(LAYER)}")
    return LAYER[name]


@dataclass(frozen=True)
class Comparison:
    """``compare_rows``'s verdict. max_abs_err: largest |out - ref|; atol, rtol: the table's
    entry; ok: every element within its bound and finite; err_to_bound: largest |out - ref| /
    (atol + rtol |ref| + slack) over the elements (<= 1 where ok; inf for NaN/Inf; 0 if empty),
    how close the worst element came to failing."""

    max_abs_err: float
    atol: float
    rtol: float
    ok: bool
    err_to_bound: float


def compare_rows(out: torch.Tensor, ref: Reference | torch.Tensor, dtype: torch.dtype | str,
                 scheme: str) -> Comparison:
    """Compares every element of ``out`` with ``ref``.

    ref: a ``Reference`` (its slack is added to the bound: ``|out - ref| <= atol + rtol |ref| +
    slack``) or a plain tensor (no slack). NaN or Inf in ``out`` never passes."""
    atol, rtol = tolerance(dtype, scheme)
    expected, slack = (ref.out, ref.slack) if isinstance(ref, Reference) else (ref, None)
    if out.shape != expected.shape:
        raise ValueError(f"compare: output shape {tuple(out.shape)} != reference shape {tuple(expected.shape)}")
    return within(out, expected, atol, rtol, slack)


def within(out: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float,
           slack: torch.Tensor | None = None) -> Comparison:
    """Every element of ``out`` against ``expected`` (same shape, any float dtype, any device:
    compared in float64 on ``out``'s): ``|out - expected| <= atol + rtol |expected| (+ slack)``.
    NaN or Inf in ``out`` never passes; an empty pair passes with error 0."""
    if out.numel() == 0:
        return Comparison(0.0, atol, rtol, True, 0.0)
    expected = expected.double().to(out.device)
    diff = (out.double() - expected).abs()
    bound = atol + rtol * expected.abs()
    if slack is not None:
        bound = bound + slack.double().to(out.device)
    finite = bool(torch.isfinite(out).all())
    ok = bool(torch.all(diff <= bound)) and finite
    ratio = float((diff / bound).max()) if finite else float("inf")
    return Comparison(float(diff.max()), atol, rtol, ok, ratio)


def compare(out: torch.Tensor, ref: Reference | torch.Tensor, dtype: torch.dtype | str,
            scheme: str) -> tuple[float, float, float, bool]:
    """(max_abs_err, atol, rtol, ok) of ``compare_rows``."""
    c = compare_rows(out, ref, dtype, scheme)
    return c.max_abs_err, c.atol, c.rtol, c.ok
