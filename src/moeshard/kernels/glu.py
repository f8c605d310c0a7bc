"""The experts' gated activation h = act(gate) * up and its backward, one pass each.

``experts.base.activate`` (the one definition) takes several torch passes over the gate_up
products [M, 2I] on the GPU: an fp32 copy, the split, the activation, the product, the rounding;
through autograd its backward takes as many again (at Qwen3-30B-A3B's 4096 tokens about 0.9 of
the 3.0 ms that the experts' forward + backward spend, ``scripts/backward_profile.py``). Here:

* ``glu_forward``: one read of gate_up, one write of h [M, I], the arithmetic in fp32 (as
  ``activate``: widened, computed, rounded to h's dtype once);
* ``glu_backward``: one read of gate_up and dL/dh, one write of dL/d(gate_up) [M, 2I] in
  gate_up's dtype: d_up = dh * act(gate), d_gate = dh * up * act'(gate), in fp32.

The kinds with a Triton epilogue (``kernel_mode``: 0 silu, 1 exact-erf gelu, 2 tanh-approximate
gelu, 3 gpt-oss's clamped SwiGLU, 4 SwiGLU on clamped products, 5 Inkling 2's soft-capped SwiGLU)
run here; the others keep the torch path. A clamp passes the gradient where its input lies within the bounds, ends included
(torch.clamp's backward), and none elsewhere. ``GatedActivation`` is the autograd Function the
portable experts use for a CUDA forward that carries gradients.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeshard.activations import get_activation
from moeshard.kernels.grouped_gemm import _act_mul, _clamp_products, _tanh
from moeshard.kernels.modes import act_constants

# The kernel modes computed here (activations.KERNEL_MODES): 0 silu, 1 exact-erf gelu, 2
# tanh-approximate gelu, 3 gpt-oss's clamped SwiGLU, 4 SwiGLU on clamped products, 5 the
# soft-capped SwiGLU.
MODES = (0, 1, 2, 3, 4, 5)
ROWS = 8  # rows per program
COLS = 256  # columns of h per program


@triton.jit
def _glu_fwd_kernel(gu_ptr, h_ptr, M, I, stride_gu, stride_h, ACT: tl.constexpr, P0: tl.constexpr,
                    P1: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr):
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    cols = tl.program_id(1) * COLS + tl.arange(0, COLS)
    ok = (rows < M)[:, None] & (cols < I)[None, :]
    gate_ptrs = gu_ptr + rows[:, None] * stride_gu + cols[None, :]
    gate = tl.load(gate_ptrs, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(gate_ptrs + I, mask=ok, other=0.0).to(tl.float32)
    h = _act_mul(gate, up, ACT, P0, P1)
    tl.store(h_ptr + rows[:, None] * stride_h + cols[None, :], h.to(h_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _clamped_inputs(g, u, LIMIT: tl.constexpr):
    """(where gate passes its clamp, where up does, the clamped gate, the clamped up)."""
    g_in = g <= LIMIT
    u_in = (u >= -LIMIT) & (u <= LIMIT)
    g, u = _clamp_products(g, u, LIMIT)
    return g_in, u_in, g, u


@triton.jit
def _glu_bwd_kernel(gu_ptr, dh_ptr, dgu_ptr, M, I, stride_gu, stride_dh, stride_dgu, ACT: tl.constexpr,
                    P0: tl.constexpr, P1: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr):
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    cols = tl.program_id(1) * COLS + tl.arange(0, COLS)
    ok = (rows < M)[:, None] & (cols < I)[None, :]
    gate_ptrs = gu_ptr + rows[:, None] * stride_gu + cols[None, :]
    g = tl.load(gate_ptrs, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(gate_ptrs + I, mask=ok, other=0.0).to(tl.float32)
    dh = tl.load(dh_ptr + rows[:, None] * stride_dh + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    # h = a(g) * v(u): d_gate = dh * v * a'(g), d_up = dh * a(g) * v'(u), with v(u) = u (modes
    # 0-2), clamp(u) + 1 (3), clamp(u) (4) or up_cap tanh(u / up_cap) (5); a clamped input takes
    # an exact zero (a select, as torch's, not a product that an inf would turn into NaN).
    CLAMPS: tl.constexpr = ACT == 3 or ACT == 4
    dv = 1.0
    if ACT == 3:  # parameters alpha, limit
        g_in, u_in, g, u = _clamped_inputs(g, u, P1)
        u = u + 1.0
    elif ACT == 4:  # parameter limit
        g_in, u_in, g, u = _clamped_inputs(g, u, P0)
    if ACT == 0 or ACT == 4:
        s = 1.0 / (1.0 + tl.exp(-g))
        a = g * s
        da = s * (1.0 + g * (1.0 - s))
    elif ACT == 3:
        # a = g sigmoid(alpha g): da = s + alpha g s (1 - s)
        s = 1.0 / (1.0 + tl.exp(-(g * P0)))
        a = g * s
        da = s + P0 * g * s * (1.0 - s)
    elif ACT == 1:
        cdf = 0.5 * (1.0 + tl.math.erf(g * 0.7071067811865476))
        a = g * cdf
        da = cdf + g * tl.exp(-0.5 * g * g) * 0.3989422804014327
    elif ACT == 2:
        # a = g (1 + t) / 2, t = tanh(z), z = k (g + c g^3): da = (1 + t) / 2 + g (1 - t^2) k (1 + 3 c g^2) / 2
        z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        t = 2.0 / (1.0 + tl.exp(-2.0 * z)) - 1.0
        a = 0.5 * g * (1.0 + t)
        da = 0.5 * (1.0 + t) + 0.5 * g * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * g * g)
    else:
        # a = c_g t_g s, t_g = tanh(g / c_g), s = sigmoid(g): da = (1 - t_g^2) s + c_g t_g s (1 - s);
        # v = c_u t_u, t_u = tanh(u / c_u): dv = 1 - t_u^2
        tl.static_assert(ACT == 5, "an activation mode the backward does not compute")
        t_g = _tanh(g / P0)
        s = 1.0 / (1.0 + tl.exp(-g))
        a = P0 * t_g * s
        da = (1.0 - t_g * t_g) * s + P0 * t_g * s * (1.0 - s)
        t_u = _tanh(u / P1)
        u = P1 * t_u
        dv = 1.0 - t_u * t_u
    out = dgu_ptr + rows[:, None] * stride_dgu + cols[None, :]
    d_gate = dh * u * da
    d_up = dh * a * dv
    if CLAMPS:
        d_gate = tl.where(g_in, d_gate, 0.0)
        d_up = tl.where(u_in, d_up, 0.0)
    tl.store(out, d_gate.to(dgu_ptr.dtype.element_ty), mask=ok)
    tl.store(out + I, d_up.to(dgu_ptr.dtype.element_ty), mask=ok)


def kernel_mode_of(activation: str) -> int | None:
    """The kind's mode here (its ``kernel_mode``, one of ``MODES``), or None: the torch path
    computes it (every ungated kind). A kernel mode this file does not compute is an error, never another mode's math."""
    kind = get_activation(activation, "glu: activation")
    mode = kind.kernel_mode
    if not kind.gated:  # h = act(up): no gate to differentiate against; torch's ops compute it
        return None
    if mode is not None and mode not in MODES:
        raise ValueError(f"glu: activation {activation!r} has kernel_mode {mode}, which kernels/glu.py does not "
                         f"compute (modes {MODES}); add its forward and derivative there")
    return mode


def _check(gate_up: torch.Tensor, where: str) -> tuple[int, int]:
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.stride(1) != 1 or not gate_up.is_floating_point():
        raise ValueError(f"{where}: gate_up must be a float [M, 2I] tensor with unit column stride, got "
                         f"{gate_up.dtype} {list(gate_up.shape)} strides {gate_up.stride()}")
    return gate_up.shape[0], gate_up.shape[1] // 2


def _grid(M: int, I: int) -> tuple[int, int]:
    return triton.cdiv(M, ROWS), triton.cdiv(I, COLS)


def glu_forward(gate_up: torch.Tensor, activation: str, out_dtype: torch.dtype) -> torch.Tensor:
    """gate_up [M, 2I] (gate products in columns [0, I), up's in [I, 2I)) -> h [M, I] in
    ``out_dtype``: ``activate(gate_up, activation, out_dtype)``, computed in fp32 and rounded once."""
    M, I = _check(gate_up, "glu_forward")
    mode = kernel_mode_of(activation)
    if mode is None:
        raise ValueError(f"glu_forward: activation {activation!r} has no kernel mode; use experts.base.activate")
    h = torch.empty(M, I, dtype=out_dtype, device=gate_up.device)
    if M and I:
        p0, p1 = act_constants(activation)
        _glu_fwd_kernel[_grid(M, I)](gate_up, h, M, I, gate_up.stride(0), h.stride(0), ACT=mode, P0=p0,
                                     P1=p1, ROWS=ROWS, COLS=COLS, num_warps=4)
    return h


def glu_backward(gate_up: torch.Tensor, grad_h: torch.Tensor, activation: str) -> torch.Tensor:
    """dL/d(gate_up) [M, 2I] in gate_up's dtype from gate_up [M, 2I] and dL/dh [M, I]: what
    autograd through ``activate`` gives (the fp32 gradients rounded to gate_up's dtype)."""
    M, I = _check(gate_up, "glu_backward")
    mode = kernel_mode_of(activation)
    if mode is None:
        raise ValueError(f"glu_backward: activation {activation!r} has no kernel mode; use experts.base.activate")
    if tuple(grad_h.shape) != (M, I) or grad_h.stride(1) != 1:
        raise ValueError(f"glu_backward: grad_h must be [{M}, {I}] with unit column stride, got "
                         f"{list(grad_h.shape)} strides {grad_h.stride()}")
    dgu = torch.empty_like(gate_up, memory_format=torch.contiguous_format)
    p0, p1 = act_constants(activation)
    if M and I:
        _glu_bwd_kernel[_grid(M, I)](gate_up, grad_h, dgu, M, I, gate_up.stride(0), grad_h.stride(0), dgu.stride(0),
                                     ACT=mode, P0=p0, P1=p1, ROWS=ROWS, COLS=COLS, num_warps=4)
    return dgu


class GatedActivation(torch.autograd.Function):
    """h = act(gate) * up through ``glu_forward``, its backward through ``glu_backward``
    (gate_up is saved, h is not: the backward recomputes act(gate) in registers)."""

    @staticmethod
    def forward(ctx, gate_up: torch.Tensor, activation: str, out_dtype: torch.dtype) -> torch.Tensor:
        ctx.save_for_backward(gate_up)
        ctx.activation = activation
        return glu_forward(gate_up, activation, out_dtype)

    @staticmethod
    def backward(ctx, grad_h: torch.Tensor):
        (gate_up,) = ctx.saved_tensors
        return glu_backward(gate_up, grad_h.contiguous(), ctx.activation), None, None
