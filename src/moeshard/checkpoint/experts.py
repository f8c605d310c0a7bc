"""This rank's routed experts, read from a checkpoint one expert at a time.

Shapes: E experts, H hidden, I intermediate size, [lo, hi) this rank's slice of I (the whole
[0, I) under EP or without TP), w = hi - lo.

What is read, per local expert (a ``ShardSpec`` says which experts and which slice of I):

* unquantized or ``fp8_block`` from a full-precision checkpoint: exactly the kept slice, gate rows
  [lo, hi), up rows [lo, hi) (fused: [I + lo, I + hi)), down columns [lo, hi); ungated experts
  (``ActivationKind.gated`` False, read from full-precision checkpoints only) hold no gate rows. ``fp8_block``
  scales cover 128 x 128 tiles and a TP slice boundary is a tile boundary (``ShardSpec`` checks
  it), so quantizing the slice gives bit for bit the shard of the quantized full expert.
* schemes whose scales span the whole expert (``QuantScheme.whole_expert_scale``: ``fp8_tensor``,
  ``fp8_token``, ``nvfp4``) under TP: a scale of these schemes spans the whole expert
  (fp8_tensor's and nvfp4's global scale: the amax of all of ``w[e]``; fp8_token's
  per-row scale of down: a whole row of I). The shard's scale must be the full expert's, or
  the TP ranks would quantize the same expert differently and the all-reduced sum would not
  match the single-device model. So the expert's full gate/up rows and down columns are read,
  quantized, then sliced with ``QuantizedWeight.slice_out``/``slice_in``/``cat_out``, and the
  full-precision expert is dropped before the next one is read.
* a fused layout other than ``gate_up_rows`` (``checkpoint.fused``: interleaved gate/up,
  transposed ``[E, H, 2I]`` / ``[E, I, H]``, or DBRX's three stacked ``[E * I, H]`` tensors): the
  same slices of the stored tensors, converted into moeshard's layout one expert at a time.
* an NVFP4 checkpoint (NVIDIA ModelOpt: per-expert uint8 ``weight`` of e2m1 pairs, e4m3
  ``weight_scale`` per 16 values, fp32 ``weight_scale_2``; ``checkpoint.nvfp4_modelopt``) or an
  FP8 block checkpoint with FP4 experts (DeepSeek-V4: per-expert int8 ``weight`` of e2m1 pairs,
  E8M0 ``scale`` per 32 values; ``checkpoint.fp8_block_mxfp4``): the gate and up rows of the kept
  slice, and the 16- or 32-column groups of down that cover it, dequantized to the model dtype;
  then as a full-precision checkpoint (``PACKED_EXPERTS``).
* an MXFP4 checkpoint (gpt-oss: ``<name>_blocks`` / ``<name>_scales``, ``checkpoint.mxfp4``) or
  an MXFP8 one (Inkling 2: e4m3 ``<name>`` / E8M0 ``<name>_scale``, ``checkpoint.mxfp8``): the
  values and scales of the kept slice (down: the 32-column blocks that cover it), dequantized to
  the model dtype; then as a full-precision checkpoint (any scheme, the slice or whole expert).
* expert biases (``MoEConfig.expert_bias``): the gate_up bias of the kept slice (gate, then up),
  and the down bias on TP rank 0 only (``sharding``: added once to the TP-reduced sum).
* an FP8 block checkpoint (``weight`` float8_e4m3fn + ``weight_scale_inv`` fp32, w ~= q * scale,
  exactly ``QuantizedWeight("fp8_block")``'s convention): the fp8 bytes of the kept slice and the
  scale tiles that cover it, gate tiles then up tiles -- the layout ``QuantizedWeight.cat_out``
  gives, written in place so no expert is held twice (it needs the gate part to end on a tile
  boundary, I % 128 == 0, as ``cat_out`` does). Nothing goes through full precision.
* an FP8 checkpoint with per-tensor or per-row scales (ModelOpt, compressed-tensors: ``weight``
  float8_e4m3fn + ``weight_scale`` of shape [] / [1] / [N] / [N, 1], w ~= q * scale; per-expert
  tensors only): the fp8 bytes of the kept slice and each kept row's stored scale, as fp8_token
  (the down rows' scales span all of I and are the stored ones on every TP rank, so no rank
  requantizes), as fp8_tensor where one scale covers each expert weight, or dequantized for none.

Each expert's reads open and close the files (see ``reader``). Unquantized and FP8-checkpoint
slices are copied from the file mapping straight into the rank's tensors, allocated once for
all local experts; quantized ones go through one reusable scratch expert. So the resident set
peaks near this rank's share plus one expert, whatever the file size.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from moeshard.checkpoint.families import CheckpointFormat
from moeshard.checkpoint.fp8_block_mxfp4 import check_fp4, read_fp4
from moeshard.checkpoint.fused import fused_layout
from moeshard.checkpoint.mxfp4 import BLOCK as MX_BLOCK
from moeshard.checkpoint.mxfp4 import dequantize_mxfp4
from moeshard.checkpoint.mxfp8 import dequantize_mxfp8, stored_scale_name
from moeshard.checkpoint.mxfp8 import scale_names as mxfp8_scale_names
from moeshard.checkpoint.names import BlockNames, mxfp4_names, row_scale_name, stored_block_scale_name
from moeshard.checkpoint.nvfp4_modelopt import GROUP as NVFP4_GROUP
from moeshard.checkpoint.nvfp4_modelopt import check_nvfp4, read_nvfp4
from moeshard.checkpoint.reader import SafetensorsCheckpoint, TensorInfo, check_finite, torch_dtype
from moeshard.config import MoEConfig, QuantConfig
from moeshard.experts.base import ExpertWeights, Weight
from moeshard.quant import FP8_BLOCK, QuantizedWeight, from_wire, quantize_weight, to_wire
from moeshard.quant.fp8 import expand_blocks, fp8_dequantize
from moeshard.sharding import ShardSpec

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
# The formats whose experts are dequantized to the model dtype as they are read.
DEQUANTIZED_READ = ("mxfp4", "mxfp8", "modelopt_nvfp4", "fp8_block_mxfp4")
ROW_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class PackedExperts:
    """A format whose routed experts are stored per expert as packed e2m1 codes with their scales,
    dequantized as they are read. label: its name in messages; check(ckpt, name, shape) and
    read(ckpt, name, shape, dtype, (rows, columns)): its module's header check and read of one
    weight of the model's shape [R, C]; group: the columns one scale covers (a read's column
    slice starts and ends on groups); tensors: how many the checkpoint stores per weight."""

    label: str
    check: Callable[[SafetensorsCheckpoint, str, tuple[int, ...]], None]
    read: Callable[..., torch.Tensor]
    group: int
    tensors: int


PACKED_EXPERTS = {"modelopt_nvfp4": PackedExperts("NVFP4", check_nvfp4, read_nvfp4, NVFP4_GROUP, 3),
                  "fp8_block_mxfp4": PackedExperts("FP4-expert", check_fp4, read_fp4, MX_BLOCK, 2)}


def dequantize_fp8_block(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An FP8 block checkpoint's e4m3 weight [R, C] with its block scales [ceil(R/128),
    ceil(C/128)] in ``dtype``: w = q * scale per 128 x 128 tile, in fp32, rounded once."""
    rows, cols = q.shape
    return fp8_dequantize(q, expand_blocks(scale, (FP8_BLOCK, FP8_BLOCK), (rows, cols))).to(dtype)


def scale_dtypes() -> tuple[torch.dtype, ...]:
    """Dtypes an fp8 checkpoint's block scales may have: fp32, bf16 and, where this torch has it
    (2.7+), UE8M0. Looked up when needed, so that importing this module works on older torch."""
    e8m0 = torch_dtype("F8_E8M0")
    return (torch.float32, torch.bfloat16) + ((e8m0,) if e8m0 is not None else ())


def check_row_scale(ckpt: SafetensorsCheckpoint, name: str, rows: int) -> TensorInfo:
    """The header of e4m3 weight ``name``'s ``weight_scale`` (a weight of ``rows`` output rows):
    ValueError naming the tensor unless it is one value (shape [] or [1]) or one per row ([rows] or
    [rows, 1]) in fp32, bf16 or fp16."""
    sname = row_scale_name(name)
    info = ckpt.info(sname)
    if info.dtype not in ROW_SCALE_DTYPES or tuple(info.shape) not in ((), (1,), (rows,), (rows, 1)):
        raise ValueError(f"tensor {sname!r} in {str(info.file)!r} has shape {list(info.shape)} and dtype {info.dtype}; "
                         f"the scale of a weight of {rows} rows is one value ([] or [1]) or one per row ([{rows}] or "
                         f"[{rows}, 1]) in {[str(d) for d in ROW_SCALE_DTYPES]}")
    return info


def read_row_scale(ckpt: SafetensorsCheckpoint, name: str, rows: int) -> torch.Tensor:
    """The ``weight_scale`` of e4m3 weight ``name`` (``rows`` output rows) as fp32 [rows, 1]; see
    ``read_row_scales``."""
    return read_row_scales(ckpt, [(name, rows)])[0]


def read_row_scales(ckpt: SafetensorsCheckpoint, weights: Sequence[tuple[str, int]]) -> list[torch.Tensor]:
    """The ``weight_scale`` of each e4m3 weight ``(name, rows)`` as fp32 [rows, 1], each stored value
    expanded to the rows it scales, read in one pass (each file opened once); ValueError naming the
    tensor unless its header passes ``check_row_scale`` and every value is finite and > 0."""
    infos = [check_row_scale(ckpt, name, rows) for name, rows in weights]
    stored = ckpt.read_many([(row_scale_name(name), ()) for name, _ in weights])
    out = []
    for (name, rows), info, raw in zip(weights, infos, stored, strict=True):
        sname = row_scale_name(name)
        scale = raw.float().reshape(-1, 1).expand(rows, 1).contiguous()
        check_finite(scale, sname, info.file)
        if not bool((scale > 0).all()):
            raise ValueError(f"tensor {sname!r} in {str(info.file)!r}: a scale is <= 0 (min {scale.min().item()!r})")
        out.append(scale)
    return out


def _blocks(n: int) -> int:
    return -(-n // FP8_BLOCK)


@dataclass(frozen=True)
class ExpertPlan:
    """What one rank reads. experts: the logical expert of each local slot, in slot order (a
    range without load balancing; with a placement a replica's expert is read once per slot);
    keep: its [lo, hi) of I; read: the [lo, hi) of I read from the file (``keep``, or all of I for
    schemes whose scales span the expert)."""

    experts: range | tuple[int, ...]
    keep: tuple[int, int]
    read: tuple[int, int]

    @staticmethod
    def of(cfg: MoEConfig, quant: QuantConfig, spec: ShardSpec, fp8_checkpoint: bool) -> ExpertPlan:
        I = cfg.intermediate_size
        width = I // spec.tp_size
        keep = (spec.tp_rank * width, (spec.tp_rank + 1) * width)
        whole = spec.tp_size > 1 and quant.spec.whole_expert_scale and not fp8_checkpoint
        return ExpertPlan(spec.logical_experts, keep, (0, I) if whole else keep)


class _Stack:
    """Per-expert weights ``[1, N, K]`` (tensors or ``QuantizedWeight``) gathered into ``[E_l, N, K]``.

    The destination is allocated once, from the first expert, so the experts are never held
    twice (a list plus a ``cat``)."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.buffers: list[torch.Tensor | None] | None = None
        self.first: Weight | None = None

    @staticmethod
    def _parts(w: Weight) -> list[torch.Tensor | None]:
        return [w.data, w.scale, w.global_scale] if isinstance(w, QuantizedWeight) else [w]

    def put(self, i: int, w: Weight) -> None:
        parts = self._parts(w)
        if self.buffers is None:
            self.first = w
            self.buffers = [None if p is None else torch.empty((self.count, *p.shape[1:]), dtype=p.dtype)
                            for p in parts]
        # Every expert of one stack has the same kind of weight, so the same parts as the first.
        for buf, p in zip(self.buffers, parts, strict=True):
            if buf is not None:
                assert p is not None  # buf exists because the first expert's part did
                to_wire(buf)[i:i + 1].copy_(to_wire(p))  # bytes: float8 has no copy_ on every build

    def result(self) -> Weight:
        w, bufs = self.first, self.buffers
        if w is None or bufs is None:
            raise ValueError(f"_Stack.result: no expert was put (count={self.count})")
        data = bufs[0]
        assert data is not None  # the first part (data, or the plain tensor) is never None
        if isinstance(w, QuantizedWeight):
            scale = bufs[1]
            assert scale is not None  # a QuantizedWeight's scale is never None
            return QuantizedWeight(w.scheme, from_wire(data, w.data.dtype), scale, bufs[2],
                                   (self.count, w.shape[1], w.shape[2]))
        return data


class ExpertReader:
    """Reads the routed experts of one block (names, cfg) from ``ckpt`` for one rank's plan."""

    def __init__(self, ckpt: SafetensorsCheckpoint, names: BlockNames, cfg: MoEConfig, fmt: CheckpointFormat) -> None:
        if (fmt.stored_scheme is not None and fmt.weight_scales is None) or (fmt.dequantized and
                                                                          fmt.name not in DEQUANTIZED_READ):
            raise ValueError(f"checkpoint format {fmt.name!r} ({fmt.summary}): its experts are not read yet "
                             f"(readable: full precision, fp8 with block or per-tensor / per-row scales, and "
                             f"{', '.join(DEQUANTIZED_READ)})")
        self.ckpt, self.names, self.cfg, self.format = ckpt, names, cfg, fmt
        self.packed = PACKED_EXPERTS.get(fmt.name)  # per-expert e2m1 weights, dequantized
        self.fp8 = fmt.weight_scales == "block" and self.packed is None  # e4m3 experts with block scales
        self.row_fp8 = fmt.weight_scales == "row"
        self.mxfp4 = fmt.name == "mxfp4"
        self.mxfp8 = fmt.weight_scales == "mx"
        self.mx = self.mxfp4 or self.mxfp8  # fused values with one exponent byte per 32, dequantized
        self.layout = fused_layout(names.fused_layout)
        mx = f"an {fmt.name.upper()} checkpoint"
        if (self.row_fp8 or self.packed) and names.fused:
            raise ValueError(f"{names.fused_gate_up}: {fmt.summary} is read with per-expert tensors "
                             f"({names.prefix}{names.family.experts}.<e>.<projection>.weight) only, not fused ones")
        if self.fp8 and names.fused and self.layout.name != "gate_up_rows":
            raise ValueError(f"{names.fused_gate_up}: an fp8 checkpoint is read with fused layout 'gate_up_rows' "
                             f"only, its family's is {self.layout.name!r}")
        if (self.mx or cfg.expert_bias) and self.layout.stacked:
            what = mx if self.mx else "experts with biases"
            raise ValueError(f"{names.fused_gate_up}: {what} in fused layout 'stacked' is not read")
        if (self.fp8 or self.mx) and not cfg.activation_kind.gated:
            raise ValueError(f"{names.prefix}{names.family.experts}: ungated experts ({cfg.activation}) are read from a "
                             f"full-precision checkpoint only, not from {fmt.summary}")
        if (self.mx or cfg.expert_bias) and not names.fused:
            what = mx if self.mx else "experts with biases"
            raise ValueError(f"{names.prefix}{names.family.experts}: {what} must be stored as fused tensors "
                             f"({names.fused_gate_up}, ...); per-expert tensors are not read for it")
        self._check_shapes()

    @property
    def products(self) -> int:
        """gate_up rows per column of I: 2 (gate and up), 1 for ungated experts (up alone)."""
        return self.cfg.activation_kind.products

    @property
    def gate_up_projections(self) -> tuple[str, ...]:
        """The stored projections of gate_up, in its row order: (gate, up), or (up,) ungated."""
        return ("gate", "up")[2 - self.products:]

    @property
    def projections(self) -> int:
        """Stored weights per expert: 3 (gate, up, down), 2 for ungated experts (up, down)."""
        return 1 + self.products

    # -- validation, from headers only ----------------------------------------------------
    def _check_shapes(self) -> None:
        E, H, I = self.cfg.num_experts, self.cfg.hidden_size, self.cfg.intermediate_size
        weight_dtypes = (torch.float8_e4m3fn,) if self.fp8 or self.row_fp8 else FLOAT_DTYPES
        n = self.names
        want: dict[str, tuple[int, ...]]
        scales: dict[str, tuple[int, ...]]
        shape: tuple[int, ...]  # a 2-d per-expert shape below, then any shape of want / scales
        if self.mx:
            self._check_mx_shapes()
            want, scales = {}, {}
        elif self.packed:
            self._check_packed_shapes(self.packed)
            want, scales = {}, {}
        elif n.fused:
            want = dict(zip(n.fused_tensors, self.layout.stored_shapes(E, H, I), strict=True))
            scales = {self._block_scale(n.fused_gate_up): (E, _blocks(2 * I), _blocks(H)),
                      self._block_scale(n.fused_down): (E, _blocks(H), _blocks(I))}
        else:
            per_expert = self.projections * E * (2 if self.fp8 or self.row_fp8 else 1)
            if per_expert > len(self.ckpt):
                raise ValueError(f"the config's num_experts={E} needs {per_expert} per-expert tensors for "
                                 f"{n.prefix}experts.*, but the checkpoint under {str(self.ckpt.model_dir)!r} "
                                 f"holds {len(self.ckpt)} tensors in all")
            want, scales = {}, {}
            for e in range(E):
                for proj, shape in (("gate", (I, H)), ("up", (I, H)), ("down", (H, I)))[3 - self.projections:]:
                    want[n.expert(e, proj)] = shape
                    scales[self._block_scale(n.expert(e, proj))] = (_blocks(shape[0]), _blocks(shape[1]))
        for name, shape in want.items():
            self.ckpt.expect(name, shape, weight_dtypes)
        if self.cfg.expert_bias:
            self.ckpt.expect(n.fused_gate_up_bias, (E, self.cfg.gate_up_size), FLOAT_DTYPES)
            self.ckpt.expect(n.fused_down_bias, (E, H), FLOAT_DTYPES)
        if self.row_fp8:
            for name, shape in want.items():
                check_row_scale(self.ckpt, name, shape[0])
        if self.fp8:
            for name, shape in scales.items():
                self.ckpt.expect(name, shape, scale_dtypes())
            if not n.fused and I % FP8_BLOCK:
                raise ValueError(f"fp8 checkpoint: intermediate size I={I} is not a multiple of {FP8_BLOCK}, so the "
                                 f"per-expert gate and up tiles cannot be fused into one fp8_block weight "
                                 f"without requantizing")

    def _check_mx_shapes(self) -> None:
        E, H, I, n = self.cfg.num_experts, self.cfg.hidden_size, self.cfg.intermediate_size, self.names
        for what, k in (("hidden_size", H), ("intermediate_size", I)):
            if k % MX_BLOCK:
                raise ValueError(f"{self.format.name.upper()} checkpoint: {what}={k} is not a multiple of its "
                                 f"{MX_BLOCK}-value blocks")
        for name, (rows, cols) in ((n.fused_gate_up, (2 * I, H)), (n.fused_down, (H, I))):
            values, scales = self._mx_names(name)
            if self.mxfp4:
                self.ckpt.expect(values, (E, rows, cols // MX_BLOCK, MX_BLOCK // 2), (torch.uint8,))
            else:
                self.ckpt.expect(values, (E, rows, cols), (torch.float8_e4m3fn,))
            self.ckpt.expect(scales, (E, rows, cols // MX_BLOCK), (torch.uint8,))

    def _check_packed_shapes(self, packed: PackedExperts) -> None:
        E, H, I, n = self.cfg.num_experts, self.cfg.hidden_size, self.cfg.intermediate_size, self.names
        for what, k in (("hidden_size", H), ("intermediate_size", I)):
            if k % packed.group:
                raise ValueError(f"{packed.label} checkpoint: {what}={k} is not a multiple of its {packed.group}-value "
                                 f"groups")
        count = packed.tensors * self.projections * E
        if count > len(self.ckpt):
            raise ValueError(f"the config's num_experts={E} needs {count} per-expert tensors for {n.prefix}experts.* "
                             f"(each weight with its scales), but the checkpoint under {str(self.ckpt.model_dir)!r} "
                             f"holds {len(self.ckpt)} tensors in all")
        for e in range(E):
            for proj, shape in (("gate", (I, H)), ("up", (I, H)), ("down", (H, I)))[3 - self.projections:]:
                packed.check(self.ckpt, n.expert(e, proj), shape)

    def _mx_names(self, fused_name: str) -> tuple[str, str]:
        """(values, scales) of a fused parameter in an MX checkpoint: MXFP4's ``_blocks`` and
        ``_scales``; MXFP8's e4m3 tensor itself and the first of its scale names stored (the
        release's, when neither is: the shape check then names it missing)."""
        if self.mxfp4:
            return mxfp4_names(fused_name)
        return fused_name, stored_scale_name(self.ckpt.has, fused_name) or mxfp8_scale_names(fused_name)[0]

    def _mx_dequantize(self, values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, name: str) -> torch.Tensor:
        """[..., K] in ``dtype`` from the values and exponents read (MXFP4: [..., K / 32, 16] bytes)."""
        return dequantize_mxfp4(values, scales, dtype) if self.mxfp4 else dequantize_mxfp8(values, scales, dtype, name)

    def _block_scale(self, weight_name: str) -> str:
        """The stored block scale of e4m3 weight ``weight_name`` (``names.stored_block_scale_name``)."""
        return stored_block_scale_name(self.ckpt.has, weight_name)

    # -- one expert -----------------------------------------------------------------------
    def _requests(self, e: int, lo: int, hi: int, scales: bool) -> list[tuple[str, tuple]]:
        """(name, index) of gate rows, up rows, down columns [lo, hi) of expert e (or of their
        scale tiles, ``scales=True``)."""
        I, n = self.cfg.intermediate_size, self.names
        name: Callable[[str], str]
        if scales:
            name = self._block_scale
            rows = lambda a, b: slice(a // FP8_BLOCK, _blocks(b))  # noqa: E731
        else:
            name = lambda s: s  # noqa: E731
            rows = slice
        if n.fused:  # gate_up_rows: gate rows [0, I), up rows [I, 2I) (the only fused layout read)
            if (lo, hi) == (0, I):
                # The whole expert: one read of all 2I rows (also the only way to read fp8 tiles that
                # straddle the gate/up boundary when I is not a multiple of 128).
                gate_up = [(name(n.fused_gate_up), (e, rows(0, 2 * I)))]
            else:
                gate_up = [(name(n.fused_gate_up), (e, rows(lo, hi))), (name(n.fused_gate_up), (e, rows(I + lo, I + hi)))]
            return gate_up + [(name(n.fused_down), (e, slice(None), rows(lo, hi)))]
        up = [(name(n.expert(e, "up")), (rows(lo, hi),)), (name(n.expert(e, "down")), (slice(None), rows(lo, hi)))]
        return up if self.projections == 2 else [(name(n.expert(e, "gate")), (rows(lo, hi),))] + up

    def _into(self, e: int, lo: int, hi: int, gate_up: torch.Tensor, down: torch.Tensor, scales: bool) -> None:
        """Reads expert e's gate/up rows and down columns [lo, hi) (or their scale tiles) straight
        into ``gate_up`` [2 rows, K] (gate half first, then up) and ``down`` [H, cols]."""
        if self.mx:
            self._mx_into(e, lo, hi, gate_up, down)
            return
        if self.packed:
            self._packed_into(self.packed, e, lo, hi, gate_up, down)
            return
        if self.names.fused and self.layout.name != "gate_up_rows":
            self._converted_into(e, lo, hi, gate_up, down)
            return
        *gu_requests, down_request = self._requests(e, lo, hi, scales)
        parts = [gate_up] if len(gu_requests) == 1 else list(gate_up.chunk(2, dim=0))
        self.ckpt.read_into(gu_requests + [down_request], parts + [down])

    def _place(self, dst: torch.Tensor, value: torch.Tensor, name: str) -> None:
        dst.copy_(value)
        check_finite(dst, name, self.ckpt.info(name).file)

    def _converted_into(self, e: int, lo: int, hi: int, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        """Another fused layout (``checkpoint.fused``): the stored slices, converted."""
        n, layout, I = self.names, self.layout, self.cfg.intermediate_size
        tensors = n.fused_tensors
        parts = self.ckpt.read_many([(tensors[which], index) for which, index in layout.expert_reads(e, lo, hi, I)])
        gate_up_rows, down_rows = layout.expert_rows(parts)
        self._place(gate_up, gate_up_rows, n.fused_gate_up)
        self._place(down, down_rows, n.fused_down)

    def _mx_into(self, e: int, lo: int, hi: int, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        """MX values and scales of the slice, dequantized: gate_up rows (the family's gate/up order,
        blocks along H) and the 32-column blocks of down that cover [lo, hi)."""
        n, rows, I, dtype = self.names, self.layout.rows, self.cfg.intermediate_size, gate_up.dtype
        gu_values, gu_scales = self._mx_names(n.fused_gate_up)
        parts = []
        for index in rows.gate_up_reads(e, lo, hi, I):
            values, scales = self.ckpt.read_many([(gu_values, index), (gu_scales, index)])
            parts.append(self._mx_dequantize(values, scales, dtype, gu_values))
        self._place(gate_up, rows.gate_up_rows(parts), gu_values)
        first, last = lo // MX_BLOCK, -(-hi // MX_BLOCK)
        dn_values, dn_scales = self._mx_names(n.fused_down)
        # MXFP4's blocks are indexed by block, MXFP8's values by column.
        columns = slice(first, last) if self.mxfp4 else slice(first * MX_BLOCK, last * MX_BLOCK)
        values, scales = self.ckpt.read_many([(dn_values, (e, slice(None), columns)),
                                              (dn_scales, (e, slice(None), slice(first, last)))])
        whole = self._mx_dequantize(values, scales, dtype, dn_values)
        self._place(down, whole[:, lo - first * MX_BLOCK:hi - first * MX_BLOCK], dn_values)

    def _packed_into(self, packed: PackedExperts, e: int, lo: int, hi: int, gate_up: torch.Tensor,
                     down: torch.Tensor) -> None:
        """Packed per-expert weights of the slice, dequantized: the gate rows [lo, hi), then the up
        rows (ungated: the up rows alone), and the column groups of down that cover [lo, hi)."""
        n, H, I, dtype, g = self.names, self.cfg.hidden_size, self.cfg.intermediate_size, gate_up.dtype, packed.group
        rows = [packed.read(self.ckpt, n.expert(e, p), (I, H), dtype, (slice(lo, hi), slice(None)))
                for p in self.gate_up_projections]
        self._place(gate_up, torch.cat(rows), n.expert(e, self.gate_up_projections[0]))
        first, last = lo // g * g, -(-hi // g) * g
        covered = packed.read(self.ckpt, n.expert(e, "down"), (H, I), dtype, (slice(None), slice(first, last)))
        self._place(down, covered[:, lo - first:hi - first], n.expert(e, "down"))

    def _read_biases(self, plan: ExpertPlan, spec: ShardSpec) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(gate_up bias [E_l, 2w] of the kept slice, gate then up; down bias [E_l, H] on TP rank 0,
        else None), in the model dtype; (None, None) without ``expert_bias``."""
        if not self.cfg.expert_bias:
            return None, None
        (lo, hi), n, I, dtype = plan.keep, self.names, self.cfg.intermediate_size, self.cfg.dtype
        gate_up = torch.empty(len(plan.experts), self.products * (hi - lo), dtype=dtype)
        down = torch.empty(len(plan.experts), self.cfg.hidden_size, dtype=dtype) if spec.tp_rank == 0 else None
        for i, e in enumerate(plan.experts):
            parts = self.ckpt.read_many([(n.fused_gate_up_bias, index) for index in self.layout.bias_reads(e, lo, hi, I)])
            self._place(gate_up[i], self.layout.bias_rows(parts), n.fused_gate_up_bias)
            if down is not None:
                self._place(down[i], self.ckpt.read(n.fused_down_bias, (e,)), n.fused_down_bias)
        return gate_up, down

    def _check_scales(self, e: int, lo: int, hi: int, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        if not (bool((gate_up > 0).all()) and bool((down > 0).all())):
            names = [name for name, _ in self._requests(e, lo, hi, scales=True)]
            raise ValueError(f"fp8 checkpoint: a block scale of expert {e} is <= 0 (tensors {names})")

    def read(self, quant: QuantConfig, spec: ShardSpec) -> ExpertWeights:
        """This rank's ``ExpertWeights`` for ``quant`` and ``spec`` (validated here)."""
        spec.validate(self.cfg, quant)
        plan = ExpertPlan.of(self.cfg, quant, spec, self.fp8 or self.row_fp8)
        if self.row_fp8:
            experts = self._read_row_fp8(plan, quant.scheme)
        elif self.fp8 and quant.quantized:
            experts = self._read_fp8(plan)
        elif self.fp8:
            experts = self._read_fp8_dequantized(plan)
        elif not quant.quantized:
            experts = self._read_plain(plan)
        else:
            experts = self._read_quantized(plan, quant)
        gate_up_bias, down_bias = self._read_biases(plan, spec)
        return dataclasses.replace(experts, gate_up_bias=gate_up_bias, down_bias=down_bias)

    def _read_plain(self, plan: ExpertPlan) -> ExpertWeights:
        """Model-dtype slices, copied from the file straight into the rank's tensors."""
        (lo, hi), E_l, H = plan.keep, len(plan.experts), self.cfg.hidden_size
        gate_up = torch.empty(E_l, self.products * (hi - lo), H, dtype=self.cfg.dtype)
        down = torch.empty(E_l, H, hi - lo, dtype=self.cfg.dtype)
        for i, e in enumerate(plan.experts):
            self._into(e, lo, hi, gate_up[i], down[i], scales=False)
        return ExpertWeights(gate_up, down, "none")

    def _read_fp8(self, plan: ExpertPlan) -> ExpertWeights:
        """fp8 bytes and fp32 tile scales of the kept slice, as stored; gate tiles then up tiles,
        which is what ``QuantizedWeight.cat_out`` of the two parts gives."""
        (lo, hi), E_l, H = plan.keep, len(plan.experts), self.cfg.hidden_size
        w = hi - lo
        gu_data = torch.empty(E_l, 2 * w, H, dtype=torch.float8_e4m3fn)
        dn_data = torch.empty(E_l, H, w, dtype=torch.float8_e4m3fn)
        gu_rows = _blocks(2 * w) if (lo, hi) == (0, self.cfg.intermediate_size) and self.names.fused else 2 * _blocks(w)
        gu_scale = torch.empty(E_l, gu_rows, _blocks(H))
        dn_scale = torch.empty(E_l, _blocks(H), _blocks(w))
        for i, e in enumerate(plan.experts):
            self._into(e, lo, hi, gu_data[i], dn_data[i], scales=False)
            self._into(e, lo, hi, gu_scale[i], dn_scale[i], scales=True)
            self._check_scales(e, lo, hi, gu_scale[i], dn_scale[i])
        # Constructing the QuantizedWeight checks the layout: a gate/up seam inside a 128-row tile
        # (I not a multiple of 128) would not match the [E, ceil(2w/128), .] scale shape.
        gate_up = QuantizedWeight("fp8_block", gu_data, gu_scale, None, (E_l, 2 * w, H))
        return ExpertWeights(gate_up, QuantizedWeight("fp8_block", dn_data, dn_scale, None, (E_l, H, w)), "fp8_block")

    def _read_fp8_dequantized(self, plan: ExpertPlan) -> ExpertWeights:
        """quant none from an FP8 block checkpoint: per expert, the fp8 bytes and scales of the
        128-row tiles that cover the kept slice of I (the whole expert where I is not a multiple of
        128: a tile may then straddle gate and up), dequantized as the dense weights are
        (``dequantize_fp8_block``), then cut to the slice (any TP slice, a tile boundary or not)."""
        (lo, hi), E_l, H, I = plan.keep, len(plan.experts), self.cfg.hidden_size, self.cfg.intermediate_size
        dtype = self.cfg.dtype
        a, b = (lo // FP8_BLOCK * FP8_BLOCK, min(I, _blocks(hi) * FP8_BLOCK)) if I % FP8_BLOCK == 0 else (0, I)
        w = b - a
        gate_up = torch.empty(E_l, 2 * (hi - lo), H, dtype=dtype)
        down = torch.empty(E_l, H, hi - lo, dtype=dtype)
        gu_data = torch.empty(2 * w, H, dtype=torch.float8_e4m3fn)
        dn_data = torch.empty(H, w, dtype=torch.float8_e4m3fn)
        gu_scale = torch.empty(_blocks(2 * w) if (a, b) == (0, I) and self.names.fused else 2 * _blocks(w), _blocks(H))
        dn_scale = torch.empty(_blocks(H), _blocks(w))
        for i, e in enumerate(plan.experts):
            self._into(e, a, b, gu_data, dn_data, scales=False)
            self._into(e, a, b, gu_scale, dn_scale, scales=True)
            self._check_scales(e, a, b, gu_scale, dn_scale)
            rows = dequantize_fp8_block(gu_data, gu_scale, dtype)  # gate rows [a, b), then up rows [a, b)
            gate_up[i] = torch.cat([rows[lo - a:hi - a], rows[w + lo - a:w + hi - a]])
            down[i] = dequantize_fp8_block(dn_data, dn_scale, dtype)[:, lo - a:hi - a]
        return ExpertWeights(gate_up, down, "none")

    def _row_scales(self, experts: Sequence[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each expert's fp32 scales of a checkpoint with per-tensor or per-row scales: gate_up rows
        [products * I] (gate's then up's) and down rows [H], each stored scale expanded to its rows;
        every scale of ``experts`` read in one pass."""
        I, H, P = self.cfg.intermediate_size, self.cfg.hidden_size, len(self.gate_up_projections)
        weights = [(self.names.expert(e, p), I) for e in experts for p in self.gate_up_projections]
        weights += [(self.names.expert(e, "down"), H) for e in experts]
        scales = [t[:, 0] for t in read_row_scales(self.ckpt, weights)]
        downs = scales[P * len(experts):]
        return [(torch.cat(scales[P * i:P * (i + 1)]), downs[i]) for i in range(len(experts))]

    def _one_scale(self, e: int, gate_up: torch.Tensor, down: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fp8_tensor's scale of expert e's gate_up and of its down ([] each), which the stored per-row
        scales give without requantizing only where each weight's are one value; ValueError naming the
        tensors and the values otherwise (gate's and up's differ, or a weight is scaled per row)."""
        for what, scales, projections in (("gate_up", gate_up, self.gate_up_projections),
                                          ("down", down, ("down",))):
            if not bool((scales == scales[0]).all()):
                names = [row_scale_name(self.names.expert(e, p)) for p in projections]
                raise ValueError(f"quant 'fp8_tensor' takes one scale for expert {e}'s {what}, but its stored scales "
                                 f"{names} hold {len(torch.unique(scales))} values ({scales.min().item():.6g} to "
                                 f"{scales.max().item():.6g}); load this checkpoint as 'fp8_token' (a scale per row, "
                                 f"as stored) or 'none'")
        return gate_up[0], down[0]

    def _read_row_fp8(self, plan: ExpertPlan, scheme: str) -> ExpertWeights:
        """An fp8 checkpoint with per-tensor or per-row scales: the e4m3 bytes of the kept slice and
        the stored scales of its rows, as fp8_token (a scale per output row; down's span all of I and
        are the stored ones on every TP rank), as fp8_tensor (``_one_scale``), or dequantized in fp32
        and rounded once to the model dtype (``none``), as the dense weights are."""
        (lo, hi), E_l, H, I = plan.keep, len(plan.experts), self.cfg.hidden_size, self.cfg.intermediate_size
        w, P = hi - lo, self.products
        gu_data = torch.empty(E_l, P * w, H, dtype=torch.float8_e4m3fn)
        dn_data = torch.empty(E_l, H, w, dtype=torch.float8_e4m3fn)
        gu_scale, dn_scale = torch.empty(E_l, P * w), torch.empty(E_l, H)
        tensor_scales = torch.empty(2, E_l)
        for i, (e, (gate_up, down)) in enumerate(zip(plan.experts, self._row_scales(plan.experts), strict=True)):
            self._into(e, lo, hi, gu_data[i], dn_data[i], scales=False)
            if scheme == "fp8_tensor":
                tensor_scales[0, i], tensor_scales[1, i] = self._one_scale(e, gate_up, down)
            gu_scale[i] = torch.cat([gate_up[p * I + lo:p * I + hi] for p in range(P)])
            dn_scale[i] = down
        if scheme == "none":
            return ExpertWeights(fp8_dequantize(gu_data, gu_scale[:, :, None]).to(self.cfg.dtype),
                                 fp8_dequantize(dn_data, dn_scale[:, :, None]).to(self.cfg.dtype), "none")
        if scheme == "fp8_tensor":
            gu_scale, dn_scale = tensor_scales[0].clone(), tensor_scales[1].clone()
        return ExpertWeights(QuantizedWeight(scheme, gu_data, gu_scale, None, (E_l, P * w, H)),
                             QuantizedWeight(scheme, dn_data, dn_scale, None, (E_l, H, w)), scheme)

    def _read_quantized(self, plan: ExpertPlan, quant: QuantConfig) -> ExpertWeights:
        """Each expert read into one scratch buffer in the model dtype, quantized, sliced to the
        kept part when the read covered the whole expert, and stacked."""
        I, H = self.cfg.intermediate_size, self.cfg.hidden_size
        (klo, khi), (rlo, rhi) = plan.keep, plan.read
        scratch_gu = torch.empty(1, self.products * (rhi - rlo), H, dtype=self.cfg.dtype)
        scratch_dn = torch.empty(1, H, rhi - rlo, dtype=self.cfg.dtype)
        gate_ups, downs = _Stack(len(plan.experts)), _Stack(len(plan.experts))
        for i, e in enumerate(plan.experts):
            self._into(e, rlo, rhi, scratch_gu[0], scratch_dn[0], scales=False)
            gu, dn = quantize_weight(scratch_gu, quant.scheme), quantize_weight(scratch_dn, quant.scheme)
            if (rlo, rhi) != (klo, khi):
                # Whole expert read for a whole-expert scale: keep this rank's slice only.
                gu = QuantizedWeight.cat_out([gu.slice_out(r.start, r.stop)
                                              for r in self.cfg.activation_kind.gate_up_rows(klo, khi, I)])
                dn = dn.slice_in(klo, khi)
            gate_ups.put(i, gu)
            downs.put(i, dn)
        return ExpertWeights(gate_ups.result(), downs.result(), quant.scheme)
