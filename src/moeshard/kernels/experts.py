"""``TritonExperts``: the routed experts on Triton kernels, a drop-in for ``GroupedExperts``.

    expert_ids [M] --align_rows--> tile plan (BLOCK_M rows per tile, one expert each)
    x [M / repeat, H] (model dtype or quantized) --gate_up GEMM, act fused, routed row m gathered
        from x[m // repeat] (or, ``ExpertsConfig.lay_out_a``, read from x laid out at the padded
        positions first, ``kernels.layout``)--> h [P, I]
    h --quantize_h (scheme; per-expert amax, or fp8_token's row maxima, from the GEMM epilogue)--> h_q [P, I]
    h_q --down GEMM, rows scattered to their original order--> y [M, H]
    (one token's fp8 rows on the direct plan, ``ExpertsConfig.quantize_in_down``: no quantize_h;
    the down GEMM reads h and quantizes each tile's one row as it loads it, the same bits; or,
    ``ExpertsConfig.gemv``, both GEMMs as matrix-vector products, ``kernels.gemv``)
    (nvfp4 at prefill, ``ExpertsConfig.decode_nvfp4``: x, h_q and where chosen the weights are
    decoded to fp16 values once, ``kernels.nvfp4_values``, instead of in every GEMM program; the
    weights a window of ``decode_experts`` experts at a time, each GEMM launched per window)

Expert biases (``ExpertWeights.gate_up_bias`` / ``down_bias``, gpt-oss) are added in the GEMMs'
epilogues, to the products rounded to the model dtype, as ``GroupedExperts`` adds them.

Padding rows (expert id -1) are never placed in a tile: nothing computes them and their output
rows are left unwritten. Five launches for bf16/fp16 (histogram, plan, scatter, two GEMMs), six when quantized
(two fewer when the tile plan is one program, at most 64 routed rows; three fewer for one
token's rows, ``ExpertsConfig.direct``: a tile per row, no plan kernel; and there, with
``quantize_in_down``, no quantize_h); no host
sync, no sort, no gather or unpermute pass over rows (and, with ``repeat``, no copy of a token per
routed row: the gate_up GEMM reads row m // repeat). Numerics are the reference's: the gate_up product is
rounded to the model dtype, h = act(gate) * up in fp32 rounded to the model dtype, then h is
quantized exactly as ``quantize_activations`` would (per-tensor scales per expert). On Hopper
and later, decode steps launch the plan and gate_up (and, where ``select_config`` chose it,
quantize_h and down) under programmatic dependent launch (``ExpertsConfig.pdl``,
``moeshard.kernels.pdl``): the same kernels and bits, each starting while the one ahead ends.
"""

from __future__ import annotations

import dataclasses

import torch

from moeshard.activations import get_activation
from moeshard.experts.base import EXPERT_BLOCKS, FLAT, ExpertInput, ExpertWeights
from moeshard.experts.grouped import GroupedExperts
from moeshard.kernels import pdl
from moeshard.kernels.align import align_rows, direct_rows, max_tiles, split_tiles
from moeshard.kernels.configs import FP8, FP8_TOKEN, ExpertsConfig, GemvConfig, gpu_kind, multiprocessors, select_config
from moeshard.kernels.gemv import down_gemv, gate_up_gemv
from moeshard.kernels.grouped_gemm import moe_gemm
from moeshard.kernels.layout import lay_out_rows
from moeshard.kernels.modes import GLUON_ACT_MODES
from moeshard.kernels.nvfp4_values import Nvfp4Values, nvfp4_values
from moeshard.kernels.quant import quantize_h
from moeshard.kernels.quant_rows import MODES as ROW_MODES
from moeshard.kernels.quant_rows import quantize_rows
from moeshard.numerics import ACCUMULATION
from moeshard.quant import FP8_DTYPE, QuantizedActivations, QuantizedWeight, get_scheme, quantize_activations


def gluon_supported(device: torch.device) -> bool:
    """Whether ``device`` runs the Gluon GEMMs (``kernels.persistent_down``,
    ``kernels.persistent_gate_up``): False too where the installed Triton has no Gluon to import."""
    try:
        from moeshard.kernels import persistent_down
    except ImportError:
        return False
    return persistent_down.supported(device)


class TritonExperts(GroupedExperts):
    """Routed experts on the fused Triton kernels; bf16/fp16 models, every quant scheme.

    activation: a registered kind with a ``kernel_mode`` (``moeshard.activations``); out_dtype: bfloat16 or float16.
    config: fixed tile shapes (the benchmark's tuner passes candidates); None picks them from
    the shapes (``moeshard.kernels.configs.select_config``).
    fp8_gate_up: "mma" multiplies fp8 on the fp8 tensor cores (~14-bit accumulation within each
    BLOCK_K step, fp32 across steps); "exact" widens fp8 to fp16 first (fp32-accurate sums at the
    fp16 rate). The down GEMM always uses the fp8 tensor cores.
    """

    def __init__(self, activation: str, out_dtype: torch.dtype, config: ExpertsConfig | None = None,
                 fp8_gate_up: str = "mma") -> None:
        if fp8_gate_up not in ("mma", "exact"):
            raise ValueError(f"TritonExperts: fp8_gate_up {fp8_gate_up!r} is not one of ['mma', 'exact']")
        if out_dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"TritonExperts: out_dtype must be bfloat16 or float16, got {out_dtype}")
        refusal = get_activation(activation, "TritonExperts: activation").kernel_refusal()
        if refusal is not None:
            raise ValueError(f"TritonExperts: {refusal}")
        super().__init__(activation, out_dtype)
        self.config = config
        self.fp8_gate_up = fp8_gate_up
        # The Gluon gate_up computes only some activation modes (and no biases).
        self._gluon_activation = get_activation(activation).kernel_mode in GLUON_ACT_MODES

    layouts: tuple[str, ...] = (FLAT, EXPERT_BLOCKS)  # padding rows (id -1) are never placed in a tile

    def accumulation(self, scheme: str) -> float:
        """fp8 schemes run (at least) the down GEMM on the fp8 tensor cores."""
        return ACCUMULATION["fp8_mma"] if get_scheme(scheme).kernel_mode in FP8 else ACCUMULATION["fp32"]

    def __call__(self, inp: ExpertInput, weights: ExpertWeights) -> torch.Tensor:
        """Returns [M, H] in ``out_dtype``: each routed row (x[m // inp.repeat]) through its
        expert, unweighted, in input order."""
        spec = get_scheme(weights.scheme, "ExpertWeights.scheme")
        scheme = spec.name
        ids = inp.expert_ids
        M, E = ids.shape[0], weights.num_experts
        H, I = weights.hidden_size, weights.intermediate_size
        x = inp.x
        device = ids.device
        if M == 0:
            if spec.per_tensor_activation and inp.amax_reduce is not None:
                inp.amax_reduce(torch.zeros(E, dtype=torch.float32, device=device))  # collective: join it
            return torch.empty(0, H, dtype=self.out_dtype, device=device)
        if scheme == "none":
            if isinstance(x, QuantizedActivations):
                raise TypeError(f"TritonExperts: activations are quantized ({x.scheme}), the weights are not (scheme 'none')")
            if x.dtype != self.out_dtype:
                raise TypeError(f"TritonExperts: activations are {x.dtype}, the model dtype is {self.out_dtype}")
        if scheme != "none" and not isinstance(x, QuantizedActivations):
            # defer_input_quant: quantize here, with the layer-wide amax for per-tensor scales.
            # x may hold one row per inp.repeat routed rows: quantizing it unexpanded gives each
            # routed row the same values as the expanded rows would get (row and block scales are
            # per row; without input_amax the per-tensor amax over x equals the one over its copies).
            amax_in = inp.input_amax if spec.per_tensor_activation else None
            if spec.kernel_mode in ROW_MODES and x.stride(-1) == 1:  # one fused pass, the same bits
                x = quantize_rows(x, scheme, amax=amax_in)
            else:
                x = quantize_activations(x, scheme, amax=amax_in)
        takes_pdl = pdl.supported(device)
        index = device.index if device.type == "cuda" else None
        # The Gluon gate_up computes neither biases nor every activation mode: such experts take
        # the tiles chosen for the Triton GEMMs, as on a GPU without Gluon.
        gluon = self._gluon_activation and not weights.has_bias and gluon_supported(device)
        cfg = self.config or select_config(M, E, H, I, scheme, multiprocessors(index), self.fp8_gate_up,
                                           pdl=takes_pdl, gluon=gluon, gpu=gpu_kind(index))
        if self.config is None and cfg.gate_up.engine == "gluon":
            from moeshard.kernels.persistent_gate_up import input_refusal

            if input_refusal(x) is not None:
                # An input the Gluon gate_up cannot copy rows from (shapes alone chose it): the
                # Triton kernel on the same tile.
                cfg = dataclasses.replace(cfg, gate_up=dataclasses.replace(cfg.gate_up, engine="triton"))
        if cfg.pdl != "off" and not takes_pdl:
            raise ValueError(f"TritonExperts: config.pdl={cfg.pdl!r} but {device} does not take programmatic "
                             "dependent launch (CUDA compute capability 9.0+ and Triton's gdc instructions)")
        if cfg.h_quant == "gate_up" and (scheme != "fp8_block" or I % 128):
            raise ValueError(f"TritonExperts: config.h_quant='gate_up' quantizes h of fp8_block experts whose "
                             f"intermediate size is a multiple of 128; the experts are {scheme} with I={I}")
        if cfg.h_quant == "row_max" and scheme != "fp8_token":
            raise ValueError(f"TritonExperts: config.h_quant='row_max' takes fp8_token's row maxima from the gate_up "
                             f"GEMM; the experts are {scheme}")
        if cfg.quantize_in_down and spec.kernel_mode not in FP8:
            raise ValueError(f"TritonExperts: config.quantize_in_down quantizes h of fp8_tensor, fp8_token or fp8_block "
                             f"experts in the down GEMM; the experts are {scheme}")
        if cfg.quantize_in_down and scheme == "fp8_block" and cfg.down.block_k not in (128, 256):
            raise ValueError(f"TritonExperts: config.quantize_in_down quantizes fp8_block's h one or two 128-column "
                             f"scale groups at a time in the down GEMM; down.block_k={cfg.down.block_k} is not 128 or 256")
        if cfg.decode_nvfp4 != "off" and scheme != "nvfp4":
            raise ValueError(f"TritonExperts: config.decode_nvfp4={cfg.decode_nvfp4!r} decodes nvfp4 operands, but the "
                             f"experts are {scheme}")
        if cfg.gemv is not None and spec.kernel_mode not in FP8:
            raise ValueError(f"TritonExperts: config.gemv computes fp8_tensor, fp8_token or fp8_block experts; "
                             f"the experts are {scheme}")
        front, back = cfg.pdl != "off", cfg.pdl == "all"  # plan and gate_up; quantize_h and down
        decode_a, decode_w = cfg.decode_nvfp4 != "off", cfg.decode_nvfp4 == "all"
        per_tensor = spec.per_tensor_activation
        # One token's choices (distinct experts under top-k): a tile per row, no plan kernel. The
        # buffers the plan kernel would zero are zeroed here.
        direct = cfg.direct and inp.repeat == M
        if direct and cfg.gemv is not None and isinstance(x, QuantizedActivations):  # fp8: x was quantized above
            return self._gemv(x, inp, weights, cfg.gemv, front, back)
        # On the direct plan the down GEMM may quantize h's one row per tile as it loads it.
        in_down = direct and cfg.quantize_in_down
        h_quant = "down" if in_down else cfg.h_quant
        new = torch.zeros if direct else torch.empty
        amax = new(E, dtype=torch.float32, device=device) if per_tensor else None
        # fp8_token's row maxima from the gate_up epilogue: quantize_h (or the down GEMM) then
        # reads h once.
        positions = M * cfg.block_m if direct else max_tiles(M, E, cfg.block_m) * cfg.block_m
        row_maxima = h_quant == "row_max" or (in_down and spec.kernel_mode == FP8_TOKEN)
        row_amax = new(positions, dtype=torch.float32, device=device) if row_maxima else None
        if direct:
            plan = direct_rows(ids, E, cfg.block_m)
        else:
            plan = align_rows(ids, E, cfg.block_m, amax=amax, pdl_launch=front, row_amax=row_amax)
        # The down GEMM's plan is made before the gate_up GEMM: its torch ops (when its tiles are
        # shorter) would otherwise sit between quantize_h and the down GEMM, which then could not
        # overlap quantize_h's end.
        down_plan = split_tiles(plan, cfg.down.block_m)
        stored_q: QuantizedActivations | None = None
        if h_quant == "gate_up":  # gate_up stores h quantized (the values and scales quantize_h gives)
            stored_q = QuantizedActivations(
                scheme, torch.empty(plan.padded_rows, I, dtype=FP8_DTYPE, device=device),
                torch.empty(plan.padded_rows, I // 128, dtype=torch.float32, device=device), None)
            h, h_scale = stored_q.data, stored_q.row_scale
        else:
            h, h_scale = torch.empty(plan.padded_rows, I, dtype=self.out_dtype, device=device), None
        x_in = _decoded(x) if decode_a else x
        if cfg.lay_out_a:  # one block per tile instead of a gather of rows (the same bits)
            a, gather, a_row_div = lay_out_rows(x_in, plan, inp.repeat), False, 1
        else:
            a, gather, a_row_div = x_in, True, inp.repeat
        # Decoded weights are a transient fp16 copy of one window of experts of one projection.
        for window in _windows(E, cfg.decode_experts) if decode_w else (None,):
            w_gate_up = weights.gate_up if window is None else _decoded(weights.gate_up, window)
            moe_gemm(a, w_gate_up, plan, h, cfg.gate_up, activation=self.activation, gather=gather, amax=amax,
                     fp8_exact=self.fp8_gate_up == "exact", a_row_div=a_row_div, pdl_launch=front, experts=window,
                     out_scale=h_scale, h_dtype=self.out_dtype if h_scale is not None else None, row_amax=row_amax,
                     bias=weights.gate_up_bias)
            del w_gate_up
        if amax is not None and inp.amax_reduce is not None:  # replicas on other ranks share the scale
            amax = inp.amax_reduce(amax)
        if stored_q is not None:
            h_q: torch.Tensor | QuantizedActivations = stored_q
        elif in_down:
            h_q = h
        else:
            h_q = quantize_h(h, scheme, plan, amax, pdl_launch=back, row_amax=row_amax) if scheme != "none" else h
        h_in = _decoded(h_q) if decode_a else h_q
        y = torch.empty(M, H, dtype=self.out_dtype, device=device)
        for window in _windows(E, cfg.decode_experts) if decode_w else (None,):
            w_down = weights.down if window is None else _decoded(weights.down, window)
            moe_gemm(h_in, w_down, down_plan, y, cfg.down, activation=None, gather=False, pdl_launch=back,
                     experts=window, bias=weights.down_bias, quantize_a=in_down,
                     a_amax=(amax if per_tensor else row_amax) if in_down else None,
                     prefetch_w=cfg.down_prefetch if back else 0)
            del w_down
        return y

    def _gemv(self, x: QuantizedActivations, inp: ExpertInput, weights: ExpertWeights, gemv: GemvConfig,
              front: bool, back: bool) -> torch.Tensor:
        """One token's routed rows as matrix-vector products (``ExpertsConfig.gemv``): gate_up
        (under PDL with ``front``) writes h [M, I] in the model dtype and its scales' maxima, and
        the down GEMV (under PDL with ``back``) quantizes h's rows as it loads them."""
        if not isinstance(weights.gate_up, QuantizedWeight) or not isinstance(weights.down, QuantizedWeight):
            raise TypeError(f"TritonExperts: config.gemv takes fp8 weights, got {type(weights.gate_up).__name__} and "
                            f"{type(weights.down).__name__}")
        ids = inp.expert_ids.contiguous()
        M, E, H, I = ids.shape[0], weights.num_experts, weights.hidden_size, weights.intermediate_size
        mode = get_scheme(weights.scheme).kernel_mode
        amax = torch.zeros(E, dtype=torch.float32, device=ids.device) if mode == 1 else None
        row_amax = torch.zeros(M, dtype=torch.float32, device=ids.device) if mode == FP8_TOKEN else None
        h = torch.empty(M, I, dtype=self.out_dtype, device=ids.device)
        gate_up_gemv(x, weights.gate_up, ids, h, gemv, activation=self.activation, x_row_div=inp.repeat,
                     amax=amax, row_amax=row_amax, bias=weights.gate_up_bias, pdl_launch=front)
        if amax is not None and inp.amax_reduce is not None:  # replicas on other ranks share the scale
            amax = inp.amax_reduce(amax)
        y = torch.empty(M, H, dtype=self.out_dtype, device=ids.device)
        return down_gemv(h, weights.down, ids, y, gemv, h_amax=amax if amax is not None else row_amax,
                         bias=weights.down_bias, pdl_launch=back)


def _windows(num_experts: int, per_window: int) -> list[tuple[int, int]]:
    """[lo, hi) windows of ``per_window`` experts covering all of them (one window for 0)."""
    step = per_window or num_experts
    return [(lo, min(lo + step, num_experts)) for lo in range(0, num_experts, step)]


def _decoded(t: torch.Tensor | QuantizedActivations | QuantizedWeight,
             window: tuple[int, int] | None = None) -> Nvfp4Values:
    """An nvfp4 operand decoded to fp16 values (``nvfp4_values``; weights: experts ``window``
    only); ``TritonExperts`` asks only for nvfp4 experts, whose activations and weights are
    quantized by then."""
    if isinstance(t, torch.Tensor):
        raise TypeError("TritonExperts: decode_nvfp4 needs nvfp4 operands, got an unquantized tensor")
    return nvfp4_values(t, window)
