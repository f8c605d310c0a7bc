"""Quantized expert weights and activations: the containers and the quantize functions.

Shape legend: ``E`` experts, ``N`` output features (rows of a weight), ``K`` input features
(columns of a weight, columns of the activations), ``M`` activation rows (routed tokens).

Every layout, quantize and slice decision is the scheme's codec's (``codecs.py``), looked up in
the registry (``schemes.py``). Both containers are frozen dataclasses with ``eq=False``: the
generated ``__eq__`` would compare tensors with ``==`` and raise on ``bool()``; identity equality
is what a cache or a set needs.
Every quantize / dequantize / gather here is pure torch with no host read-back, so it runs on CPU
and CUDA alike. Slicing, ``cat_out`` and ``to`` happen at load time and may synchronize.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .codecs import Codec
from .fp8 import abs_amax, from_wire, to_wire
from .schemes import BUILTIN_SCHEMES, quantized_scheme

# The built-in quantized schemes (the registry, ``moeshard.quant.schemes``, may hold more).
SCHEMES = tuple(s for s in BUILTIN_SCHEMES if s != "none")


def _codec(where: str, scheme: str) -> Codec:
    codec = quantized_scheme(scheme, where).codec
    assert codec is not None  # quantized_scheme refuses schemes without one
    return codec


def _expect(where: str, t: Tensor | None, shape: tuple[int, ...] | None, dtype: torch.dtype | None) -> None:
    # One message format for every layout check: the field, what was expected and what came.
    if shape is None:
        if t is not None:
            raise ValueError(f"{where}: expected None, got a {t.dtype} tensor of shape {list(t.shape)}")
        return
    if not isinstance(t, Tensor) or tuple(t.shape) != shape or t.dtype != dtype:
        got = f"{t.dtype} {list(t.shape)}" if isinstance(t, Tensor) else repr(t)
        raise ValueError(f"{where}: expected {dtype} {list(shape)}, got {got}")


def _same_device(where: str, **tensors: Tensor | None) -> None:
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    if len(set(devices.values())) > 1:
        raise ValueError(f"{where}: tensors are on different devices: {devices}")


def _own(t: Tensor) -> Tensor:
    # Slices are copied so that a shard owns its storage: a view would keep the full
    # (unsharded) weight alive on every rank. The copy goes through uint8 for float8.
    return from_wire(to_wire(t).clone(memory_format=torch.contiguous_format), t.dtype)


def _take(t: Tensor, ids: Tensor) -> Tensor:
    return from_wire(to_wire(t).index_select(0, ids), t.dtype)


def _cat(ts: list[Tensor], dim: int) -> Tensor:
    return from_wire(torch.cat([to_wire(t) for t in ts], dim=dim), ts[0].dtype)


def _check_index(where: str, idx: Tensor) -> None:
    if not isinstance(idx, Tensor) or idx.dim() != 1 or idx.dtype not in (torch.int64, torch.int32):
        got = f"{idx.dtype} {list(idx.shape)}" if isinstance(idx, Tensor) else repr(idx)
        raise ValueError(f"{where}: expected a 1-D int64 (or int32) index tensor, got {got}")


def _check_range(where: str, name: str, start: int, stop: int, size: int) -> None:
    for label, value in (("start", start), ("stop", stop)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"{where}: {label} must be an int, got {value!r}")
    if not 0 <= start <= stop <= size:
        raise ValueError(f"{where}: [{start}, {stop}) is not a range of {name}={size} (need 0 <= start <= stop <= {name})")


def _check_float_dtype(where: str, dtype: torch.dtype) -> None:
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"{where}: dtype must be a floating-point torch.dtype, got {dtype!r}")


def _check_block_bounds(where: str, name: str, start: int, stop: int, size: int, block: int) -> None:
    # ``size`` is the dimension's length (a stop there may end in a partial tile), -1 if none.
    if start % block or (stop % block and stop != size):
        end = f" (or the end of {name}, {size})" if size >= 0 else ""
        raise ValueError(f"{where}: boundaries [{start}, {stop}) of {name} must be multiples of {block}{end}")


def _check_equal_scales(field: str, scales: list[Tensor]) -> None:
    for i, s in enumerate(scales[1:], start=1):
        if not torch.equal(s.to(scales[0].device), scales[0]):
            raise ValueError(f"QuantizedWeight.cat_out: parts[{i}].{field} differs from parts[0].{field}; the result "
                             f"has one {field} per expert, so the parts must share it (slice them from one weight)")


@dataclass(frozen=True, eq=False)
class QuantizedWeight:
    """Stacked expert weights ``[E, N, K]`` (``y = x @ w[e].T``) in one quantized scheme.

    Fields (layouts per scheme in ``moeshard.quant.codecs``):
        scheme: a registered quantized scheme (``'fp8_tensor' | 'fp8_token' | 'fp8_block' |
            'nvfp4'`` built in).
        data: ``codec.data_dtype`` ``[E, N, K // codec.pack]`` (nvfp4: two e2m1 codes per byte,
            column 2i in the low nibble).
        scale: ``codec.weight_scale_dtype`` ``codec.weight_scale_shape(E, N, K)``: fp8_tensor
            ``[E]``, fp8_token ``[E, N]``, fp8_block ``[E, ceil(N/128), ceil(K/128)]``, nvfp4
            e4m3 ``[E, N, K // 16]`` (unswizzled).
        global_scale: fp32 ``[E]`` where the codec has one (nvfp4: ``2688 / amax(w[e])``), else None.
        shape: the logical ``(E, N, K)``.
    """

    scheme: str
    data: Tensor
    scale: Tensor
    global_scale: Tensor | None
    shape: tuple[int, int, int]

    def __post_init__(self) -> None:
        codec = _codec("QuantizedWeight.scheme", self.scheme)
        shape = tuple(self.shape)
        if len(shape) != 3 or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise ValueError(f"QuantizedWeight.shape: expected (E, N, K) of non-negative ints, got {self.shape!r}")
        object.__setattr__(self, "shape", shape)
        e, n, k = shape
        if k % codec.k_multiple:
            raise ValueError(f"QuantizedWeight.shape: {self.scheme} needs K % {codec.k_multiple} == 0, got K={k}")
        where = f"QuantizedWeight.%s ({self.scheme})"
        _expect(where % "data", self.data, (e, n, k // codec.pack), codec.data_dtype)
        _expect(where % "scale", self.scale, codec.weight_scale_shape(e, n, k), codec.weight_scale_dtype)
        _expect(where % "global_scale", self.global_scale, (e,) if codec.has_global else None, torch.float32)
        _same_device("QuantizedWeight", data=self.data, scale=self.scale, global_scale=self.global_scale)

    @property
    def codec(self) -> Codec:
        return _codec("QuantizedWeight.scheme", self.scheme)

    def _replace(self, data: Tensor, scale: Tensor, global_scale: Tensor | None, shape: tuple[int, int, int]) -> QuantizedWeight:
        return QuantizedWeight(self.scheme, data, scale, global_scale, shape)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """The weight ``[E, N, K]`` in ``dtype`` (computed in fp32, then cast)."""
        _check_float_dtype("QuantizedWeight.dequantize", dtype)
        return self.codec.dequantize_weight(self.data, self.scale, self.global_scale, self.shape).to(dtype)

    def select_experts(self, ids: Tensor) -> QuantizedWeight:
        """Keeps experts ``ids`` (int64 ``[E']``, values in ``[0, E)``, on this weight's device), in that order.

        Out-of-range ids are not checked here (that would read them back to the host); torch's
        gather raises on CPU and asserts on CUDA.
        """
        _check_index("QuantizedWeight.select_experts", ids)
        ids = ids.to(self.data.device)
        glob = None if self.global_scale is None else _take(self.global_scale, ids)
        _, n, k = self.shape
        return self._replace(_take(self.data, ids), _take(self.scale, ids), glob, (ids.shape[0], n, k))

    def slice_out(self, start: int, stop: int) -> QuantizedWeight:
        """Output rows ``[start, stop)`` of N, scales sliced to match; equals ``dequantize()[:, start:stop]``.

        Boundaries must fall on the codec's ``out_block`` (fp8_block: 128-row tiles; ``stop`` may
        also be N), since one scale cannot be split.
        """
        e, n, k = self.shape
        codec = self.codec
        _check_range("QuantizedWeight.slice_out", "N", start, stop, n)
        _check_block_bounds("QuantizedWeight.slice_out", "N", start, stop, n, codec.out_block)
        glob = None if self.global_scale is None else _own(self.global_scale)
        return self._replace(_own(self.data[:, start:stop]), _own(codec.scale_rows(self.scale, start, stop)), glob,
                             (e, stop - start, k))

    def slice_in(self, start: int, stop: int) -> QuantizedWeight:
        """Input columns ``[start, stop)`` of K, scales sliced to match; equals ``dequantize()[..., start:stop]``.

        Boundaries must fall on the codec's ``in_block`` and ``pack`` (fp8_block: 128-column tiles,
        ``stop`` may also be K; nvfp4: multiples of 16, a block scale cannot be split).
        """
        e, n, k = self.shape
        codec = self.codec
        _check_range("QuantizedWeight.slice_in", "K", start, stop, k)
        _check_block_bounds("QuantizedWeight.slice_in", "K", start, stop, k, math.lcm(codec.in_block, codec.pack))
        data = self.data[..., start // codec.pack:stop // codec.pack]
        glob = None if self.global_scale is None else _own(self.global_scale)
        return self._replace(_own(data), _own(codec.scale_cols(self.scale, start, stop)), glob, (e, n, stop - start))

    @staticmethod
    def cat_out(parts: list[QuantizedWeight]) -> QuantizedWeight:
        """Concatenates ``parts`` along N (re-fuses gate and up halves sliced from one weight).

        Requirements, each a ``ValueError`` when broken:
          * same scheme, E and K everywhere;
          * equal per-expert quantities the codec keeps whole (``codec.shared``: fp8_tensor's
            scale, nvfp4's global scale): one value must describe the whole result;
          * every part but the last has N on the codec's ``out_block`` (fp8_block: 128).
        Halves sliced from one quantized weight always satisfy these. Comparing scales reads
        them back to the host; this is a load-time operation.
        """
        if not parts:
            raise ValueError("QuantizedWeight.cat_out: parts is empty")
        first = parts[0]
        e, _, k = first.shape
        for i, p in enumerate(parts):
            if p.scheme != first.scheme or p.shape[0] != e or p.shape[2] != k:
                raise ValueError(f"QuantizedWeight.cat_out: parts[{i}] is {p.scheme!r} (E, N, K)={p.shape}, parts[0] is "
                                 f"{first.scheme!r} {first.shape}; scheme, E and K must match")
        codec = first.codec
        for field in codec.shared:
            _check_equal_scales(field, [getattr(p, field) for p in parts])
        for i, p in enumerate(parts[:-1]):
            if p.shape[1] % codec.out_block:
                raise ValueError(f"QuantizedWeight.cat_out: {first.scheme} parts[{i}] has N={p.shape[1]}, not a multiple "
                                 f"of {codec.out_block}; only the last part may end in a partial tile")
        n_total = sum(p.shape[1] for p in parts)
        data = _cat([p.data for p in parts], dim=1)
        scale = first.scale if "scale" in codec.shared else _cat([p.scale for p in parts], dim=1)
        return first._replace(data, _own(scale), None if first.global_scale is None else _own(first.global_scale),
                              (e, n_total, k))

    @staticmethod
    def cat_experts(parts: list[QuantizedWeight]) -> QuantizedWeight:
        """Concatenates ``parts`` along E (experts quantized in chunks); scheme, N and K must match."""
        if not parts:
            raise ValueError("QuantizedWeight.cat_experts: parts is empty")
        first = parts[0]
        _, n, k = first.shape
        for i, p in enumerate(parts):
            if p.scheme != first.scheme or p.shape[1:] != (n, k):
                raise ValueError(f"QuantizedWeight.cat_experts: parts[{i}] is {p.scheme!r} (E, N, K)={p.shape}, "
                                 f"parts[0] is {first.scheme!r} {first.shape}; scheme, N and K must match")
        glob = None
        if first.global_scale is not None:
            globs: list[Tensor] = []
            for p in parts:
                assert p.global_scale is not None  # same scheme as parts[0], whose codec has a global scale
                globs.append(p.global_scale)
            glob = _cat(globs, dim=0)
        return first._replace(_cat([p.data for p in parts], dim=0), _cat([p.scale for p in parts], dim=0), glob,
                              (sum(p.shape[0] for p in parts), n, k))

    def to(self, device: torch.device | str) -> QuantizedWeight:
        """The same weight on ``device``."""
        glob = None if self.global_scale is None else self.global_scale.to(device)
        return self._replace(self.data.to(device), self.scale.to(device), glob, self.shape)


def quantize_weight(w: Tensor, scheme: str) -> QuantizedWeight:
    """Quantizes stacked expert weights.

    Args:
        w: float ``[E, N, K]`` (fp32, bf16, fp16 or fp64); K a multiple of the codec's
            ``k_multiple`` (nvfp4: 16).
        scheme: a registered quantized scheme.
    Returns:
        ``QuantizedWeight`` on ``w``'s device. Per-tensor quantities are per expert: the
        fp8_tensor scale and the nvfp4 global scale use the amax of ``w[e]``.
    """
    codec = _codec("quantize_weight", scheme)
    if not isinstance(w, Tensor) or w.dim() != 3 or not w.is_floating_point():
        got = f"{w.dtype} {list(w.shape)}" if isinstance(w, Tensor) else repr(w)
        raise ValueError(f"quantize_weight: w must be a float [E, N, K] tensor, got {got}")
    e, n, k = w.shape
    if k % codec.k_multiple:
        raise ValueError(f"quantize_weight: {scheme} needs K % {codec.k_multiple} == 0, got w.shape[2] (K)={k}")
    data, scale, glob = codec.quantize_weight(w)
    return QuantizedWeight(scheme, data, scale, glob, (e, n, k))


@dataclass(frozen=True, eq=False)
class QuantizedActivations:
    """Activation rows ``[M, K]`` in one quantized scheme, as dispatched to the experts.

    Fields (layouts per scheme in ``moeshard.quant.codecs``):
        scheme: a registered quantized scheme.
        data: ``codec.data_dtype`` ``[M, K // codec.pack]`` (nvfp4: two e2m1 codes per byte,
            column 2i in the low nibble).
        row_scale: scales that belong to one row and travel with it through dispatch,
            ``codec.row_scale_dtype`` ``codec.row_scale_shape(M, K)``: fp8_token fp32 ``[M, 1]``;
            fp8_block fp32 ``[M, ceil(K / 128)]`` (one per 1 x 128 group, the last one partial);
            nvfp4 float8_e4m3fn ``[M, K // 16]`` (unswizzled); None where the codec has none
            (fp8_tensor).
        tensor_scale: where the codec has one (``codec.tensor_scale``): fp32 ``[]`` (one for all
            rows) or ``[M, 1]`` (per row, when the caller's amax was per row): fp8_tensor's scale
            (``x ~= data * tensor_scale``) or nvfp4's global scale (``x ~= e2m1(data) *
            row_scale / tensor_scale``); None otherwise.
    """

    scheme: str
    data: Tensor
    row_scale: Tensor | None
    tensor_scale: Tensor | None

    def __post_init__(self) -> None:
        codec = _codec("QuantizedActivations.scheme", self.scheme)
        where = f"QuantizedActivations ({self.scheme})"
        if not isinstance(self.data, Tensor) or self.data.dim() != 2 or self.data.dtype != codec.data_dtype:
            got = f"{self.data.dtype} {list(self.data.shape)}" if isinstance(self.data, Tensor) else repr(self.data)
            raise ValueError(f"{where}.data: expected a 2-D {codec.data_dtype} tensor, got {got}")
        m, k = self.shape
        _expect(f"{where}.row_scale", self.row_scale, codec.row_scale_shape(m, k), codec.row_scale_dtype)
        if codec.tensor_scale:
            ts = self.tensor_scale
            if not isinstance(ts, Tensor) or ts.dtype != torch.float32 or tuple(ts.shape) not in ((), (m, 1)):
                got = f"{ts.dtype} {list(ts.shape)}" if isinstance(ts, Tensor) else repr(ts)
                raise ValueError(f"{where}.tensor_scale: expected float32 [] or [{m}, 1], got {got}")
        else:
            _expect(f"{where}.tensor_scale", self.tensor_scale, None, None)
        _same_device(where, data=self.data, row_scale=self.row_scale, tensor_scale=self.tensor_scale)

    @property
    def codec(self) -> Codec:
        return _codec("QuantizedActivations.scheme", self.scheme)

    @property
    def shape(self) -> tuple[int, int]:
        """The logical ``(M, K)`` (nvfp4 stores K // 2 bytes per row)."""
        m, width = self.data.shape
        return m, width * self.codec.pack

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """The activations ``[M, K]`` in ``dtype`` (computed in fp32, then cast)."""
        _check_float_dtype("QuantizedActivations.dequantize", dtype)
        return self.codec.dequantize_activations(self.data, self.row_scale, self.tensor_scale, self.shape).to(dtype)

    def index_rows(self, idx: Tensor) -> QuantizedActivations:
        """Rows ``idx`` (int64 ``[M']``, values in ``[0, M)``) with their scales.

        ``data`` and ``row_scale`` are gathered; ``tensor_scale`` is gathered when it is per row
        (``[M, 1]``) and kept when it is ``[]``.
        """
        _check_index("QuantizedActivations.index_rows", idx)
        idx = idx.to(self.data.device)
        rows = None if self.row_scale is None else _take(self.row_scale, idx)
        ts = self.tensor_scale
        if ts is not None and ts.dim() == 2:
            ts = _take(ts, idx)
        return QuantizedActivations(self.scheme, _take(self.data, idx), rows, ts)


def _check_amax(amax: Tensor | None, x: Tensor) -> None:
    if amax is None:
        return
    m = x.shape[0]
    if not isinstance(amax, Tensor) or not amax.is_floating_point() or tuple(amax.shape) not in ((), (m, 1)):
        got = f"{amax.dtype} {list(amax.shape)}" if isinstance(amax, Tensor) else repr(amax)
        raise ValueError(f"quantize_activations: amax must be a float tensor of shape [] or [M, 1] = [{m}, 1], got {got}")
    if amax.device != x.device:
        raise ValueError(f"quantize_activations: amax is on {amax.device}, x on {x.device}")


def quantize_activations(x: Tensor, scheme: str, amax: Tensor | None = None,
                         scales_from: Tensor | None = None) -> QuantizedActivations:
    """Quantizes activation rows dynamically.

    Args:
        x: float ``[M, K]`` (fp32, bf16, fp16 or fp64); M may be 0. K a multiple of the codec's
            ``k_multiple`` (nvfp4: 16).
        scheme: a registered quantized scheme.
        amax: optional fp32 ``[]`` or ``[M, 1]``, used only for the per-tensor quantities
            (fp8_tensor's scale, nvfp4's global scale) in place of ``x.abs().amax()``: the layer
            passes an amax all-reduced over ranks, or each row's expert-group amax, so that every
            parallel layout quantizes a row identically. Per-row and per-group scales (fp8_token,
            fp8_block, nvfp4 block scales) always come from ``x`` itself; there ``amax`` is only
            validated. Default: the amax of ``x`` (0 when M = 0), raised to ``AMAX_FLOOR``.
        scales_from: optional float tensor of ``x``'s shape from which every scale is taken
            instead of from ``x`` (the per-tensor one too, unless ``amax`` is given); values beyond
            a scale's range saturate. The reference uses it to quantize one candidate value of an
            activation with the scales another candidate would produce.
    Returns:
        ``QuantizedActivations`` on ``x``'s device; its ``tensor_scale`` has ``amax``'s shape.
    """
    codec = _codec("quantize_activations", scheme)
    if not isinstance(x, Tensor) or x.dim() != 2 or not x.is_floating_point():
        got = f"{x.dtype} {list(x.shape)}" if isinstance(x, Tensor) else repr(x)
        raise ValueError(f"quantize_activations: x must be a float [M, K] tensor, got {got}")
    _check_amax(amax, x)
    if scales_from is not None and (not isinstance(scales_from, Tensor) or scales_from.shape != x.shape):
        got = str(list(scales_from.shape)) if isinstance(scales_from, Tensor) else repr(scales_from)
        raise ValueError(f"quantize_activations: scales_from must have x's shape {list(x.shape)}, got {got}")
    source = x if scales_from is None else scales_from
    k = x.shape[1]
    if k % codec.k_multiple:
        raise ValueError(f"quantize_activations: {scheme} needs K % {codec.k_multiple} == 0, got x.shape[1] (K)={k}")
    tensor_amax = abs_amax(source, (0, 1)) if amax is None else amax.float()
    data, row_scale, tensor_scale = codec.quantize_activations(x, tensor_amax, source)
    return QuantizedActivations(scheme, data, row_scale, tensor_scale)


def fake_quantize_activations(x: Tensor, scheme: str, amax: Tensor | None = None,
                              scales_from: Tensor | None = None) -> Tensor:
    """fp32 ``[M, K]``: ``x`` quantized exactly as ``quantize_activations`` does, then dequantized.

    The single-device reference uses it so that its activations carry the same quantization
    error as the layer's.
    """
    return quantize_activations(x, scheme, amax, scales_from).dequantize(torch.float32)
