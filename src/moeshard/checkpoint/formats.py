"""How a checkpoint stores its weights: the formats a family may ship (``ModelFamily.formats``),
each recognized from config.json's ``quantization_config``.

==============  ===============================================  ==========================================
format          stored weights                                   experts load as
==============  ===============================================  ==========================================
bf16            fp32 / bf16 / fp16 tensors                       any scheme
fp8_block       e4m3 ``weight`` + ``weight_scale_inv`` per       fp8_block as stored, or none
                128 x 128 tile (DeepSeek-V3)                     (dequantized)
modelopt_fp8    e4m3 ``weight`` + fp32 ``weight_scale``, one     fp8_token as stored (each row keeps its
                per tensor (NVIDIA ModelOpt ``FP8``) or per      tensor's or its own scale); fp8_tensor
                output row (``FP8_PER_CHANNEL_PER_TOKEN``)       where one scale covers a whole expert
                                                                 weight; or none (dequantized)
compressed_fp8  e4m3 ``weight`` + ``weight_scale`` per tensor    as modelopt_fp8
                or per output row (compressed-tensors
                ``float-quantized``, 8-bit float weights)
modelopt_nvfp4  e2m1 ``weight`` two a byte + e4m3                any scheme, from the dequantized values
                ``weight_scale`` per 16 values + fp32
                ``weight_scale_2`` (NVIDIA ModelOpt ``NVFP4``)
mxfp4           e2m1 ``<name>_blocks`` + e8m0 ``<name>_scales``  any scheme, from the dequantized values
                (gpt-oss)
mxfp8           e4m3 ``<name>`` + e8m0 ``<name>_scale``, one     any scheme, from the dequantized values
                per 32 values along the input axis (Inkling 2)
fp8_block_      dense: e4m3 ``weight`` + e8m0 ``scale`` per      any scheme, from the dequantized values
mxfp4           128 x 128 tile; experts: e2m1 ``weight`` two a
                byte + e8m0 ``scale`` per 32 values
                (DeepSeek-V4)
==============  ===============================================  ==========================================

In every fp8 format w = q * scale. Only the weights' storage is read: the static activation scales
some of these checkpoints hold (``input_scale``, the attention's ``k_scale`` / ``v_scale``) are not
used, because moeshard quantizes the experts' input dynamically (per row or per quantization
domain, as its scheme says) and runs attention in the model dtype. Weights a checkpoint leaves
unquantized (its ``ignore`` / ``exclude_modules``: routers, embeddings, some attention layers) are
plain float tensors, read as such.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from moeshard.validate import is_int

FP8_CHECKPOINT_BLOCK = (128, 128)
MXFP8_BLOCK = (1, 32)
# ModelOpt's quant_algo values whose weights are e4m3 with one scale per tensor (FP8) or per
# output row (FP8_PER_CHANNEL_PER_TOKEN).
MODELOPT_FP8_ALGOS = ("FP8", "FP8_PER_CHANNEL_PER_TOKEN")
NVFP4_GROUP = 16


def _is_full_precision(q: Any, source: str) -> bool:
    return q is None


def _check_fp8_block(q: dict, source: str) -> None:
    """quant_method ``fp8``'s block size and activation scheme, as moeshard reads them; ValueError
    naming the field otherwise."""
    block = q.get("weight_block_size")
    if not isinstance(block, list) or tuple(block) != FP8_CHECKPOINT_BLOCK or not all(is_int(b) for b in block):
        raise ValueError(f"{source}: fp8 quantization_config has weight_block_size={block!r}; moeshard's fp8_block "
                         f"needs {list(FP8_CHECKPOINT_BLOCK)} (per-tensor FP8 checkpoints are not supported)")
    scheme = q.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ValueError(f"{source}: fp8 quantization_config has activation_scheme={scheme!r}; only 'dynamic' "
                         f"is supported (moeshard quantizes activations per token and 128 columns)")


def _is_fp8_block(q: Any, source: str) -> bool:
    if not isinstance(q, dict) or q.get("quant_method") != "fp8":
        return False
    _check_fp8_block(q, source)
    experts = q.get("expert_dtype", "fp8")
    if experts != "fp8":
        raise ValueError(f"{source}: fp8 quantization_config has expert_dtype={experts!r}; this family reads FP8 block "
                         f"checkpoints whose experts are fp8 too, not e2m1 experts with per-32 E8M0 scales (the "
                         f"format 'fp8_block_mxfp4', DeepSeek-V4's)")
    return True


def _is_fp8_block_mxfp4(q: Any, source: str) -> bool:
    """quant_method ``fp8`` with expert_dtype ``fp4`` (DeepSeek-V4's release): FP8 block dense
    weights with UE8M0 scales, FP4 experts with an E8M0 exponent per 32 values. Another block,
    activation scheme or scale format is refused by name."""
    if not isinstance(q, dict) or q.get("quant_method") != "fp8" or q.get("expert_dtype") != "fp4":
        return False
    _check_fp8_block(q, source)
    if q.get("scale_fmt") != "ue8m0":
        raise ValueError(f"{source}: fp8 quantization_config with expert_dtype='fp4' has scale_fmt="
                         f"{q.get('scale_fmt')!r}; moeshard reads FP4 experts with scale_fmt='ue8m0' (E8M0 exponents) only")
    return True


def _is_mxfp4(q: Any, source: str) -> bool:
    return isinstance(q, dict) and q.get("quant_method") == "mxfp4"


def _is_mxfp8(q: Any, source: str) -> bool:
    """quant_method ``mxfp8`` (transformers' FineGrainedFP8 with E8M0 scales): e4m3 weights with one
    exponent byte per [1, 32] block. Another block, scale format or expert dtype is refused by name."""
    if not isinstance(q, dict) or q.get("quant_method") != "mxfp8":
        return False
    block = q.get("weight_block_size", list(MXFP8_BLOCK))
    if not isinstance(block, (list, tuple)) or tuple(block) != MXFP8_BLOCK:
        raise ValueError(f"{source}: mxfp8 quantization_config has weight_block_size={block!r}; MXFP8 scales cover "
                         f"{list(MXFP8_BLOCK)} blocks")
    for key, want in (("scale_fmt", "ue8m0"), ("expert_dtype", "fp8"), ("activation_scheme", "dynamic")):
        if q.get(key, want) != want:
            raise ValueError(f"{source}: mxfp8 quantization_config has {key}={q.get(key)!r}; moeshard reads "
                             f"{key}={want!r} only")
    return True


def _is_modelopt_fp8(q: Any, source: str) -> bool:
    """ModelOpt's export: ``quant_algo`` FP8 (or FP8_PER_CHANNEL_PER_TOKEN), or MIXED_PRECISION whose
    ``quantized_layers`` are all such; NVFP4 is another format's (``_is_modelopt_nvfp4``); any other
    algorithm (W4A8, the integer ones, ...) is refused by name."""
    if not isinstance(q, dict) or q.get("quant_method") != "modelopt":
        return False
    algo = q.get("quant_algo")
    name = algo.upper() if isinstance(algo, str) else algo
    if name == "NVFP4":
        return False
    if name in MODELOPT_FP8_ALGOS:
        return True
    if name == "MIXED_PRECISION":
        layers = q.get("quantized_layers")
        if not isinstance(layers, dict) or not layers:
            raise ValueError(f"{source}: quantization_config quant_algo 'MIXED_PRECISION' needs a non-empty "
                             f"quantized_layers object, got {layers!r}")
        others = {layer: spec.get("quant_algo") if isinstance(spec, dict) else spec for layer, spec in layers.items()
                  if not (isinstance(spec, dict) and str(spec.get("quant_algo")).upper() in MODELOPT_FP8_ALGOS)}
        if others:
            layer, what = next(iter(others.items()))
            raise ValueError(f"{source}: quantization_config quantized_layers[{layer!r}] has quant_algo {what!r} "
                             f"({len(others)} such layers); moeshard reads ModelOpt layers of quant_algo "
                             f"{list(MODELOPT_FP8_ALGOS)} only")
        return True
    raise ValueError(f"{source}: quantization_config quant_method 'modelopt' has quant_algo {algo!r}; moeshard reads "
                     f"{list(MODELOPT_FP8_ALGOS)} (and MIXED_PRECISION of those) and 'NVFP4', not the integer formats")


def _is_modelopt_nvfp4(q: Any, source: str) -> bool:
    """ModelOpt's export with ``quant_algo`` NVFP4: e2m1 weights, an e4m3 scale per 16 values and a
    global fp32 scale per weight. Another group size is refused by name."""
    if not isinstance(q, dict) or q.get("quant_method") != "modelopt" or \
            str(q.get("quant_algo", "")).upper() != "NVFP4":
        return False
    group = q.get("group_size", NVFP4_GROUP)
    if group != NVFP4_GROUP:
        raise ValueError(f"{source}: quantization_config quant_algo 'NVFP4' has group_size={group!r}; NVFP4 scales "
                         f"cover {NVFP4_GROUP} values")
    return True


def _check_scheme(group: str, what: str, spec: Any, strategies: tuple[str, ...], source: str) -> None:
    """One compressed-tensors quantization args object (``weights`` or ``input_activations``): 8-bit
    symmetric floats with one of ``strategies``; ValueError naming the field otherwise."""
    where = f"{source}: quantization_config config_groups[{group!r}].{what}"
    if not isinstance(spec, dict):
        raise ValueError(f"{where} must be an object, got {spec!r}")
    want = {"num_bits": 8, "type": "float", "symmetric": True}
    for key, value in want.items():
        if spec.get(key, value) != value:
            raise ValueError(f"{where}.{key}={spec.get(key)!r}; moeshard reads {key}={value!r} (e4m3 floats) only")
    if spec.get("strategy") not in strategies:
        raise ValueError(f"{where}.strategy={spec.get('strategy')!r}; moeshard reads {list(strategies)}")
    if spec.get("group_size") is not None or spec.get("block_structure") is not None:
        raise ValueError(f"{where}: group_size={spec.get('group_size')!r}, block_structure="
                         f"{spec.get('block_structure')!r}; grouped or block scales are not read by this format")


def _is_compressed_fp8(q: Any, source: str) -> bool:
    """compressed-tensors (``quant_method`` ``compressed-tensors``), ``float-quantized``: every config
    group's weights e4m3 with a scale per tensor or per output channel; activations dynamic or static
    (their static scales are not used) or none. Sparsity and other formats are refused by name."""
    if not isinstance(q, dict) or q.get("quant_method") != "compressed-tensors":
        return False
    if q.get("sparsity_config"):
        raise ValueError(f"{source}: quantization_config has a sparsity_config; sparse compressed-tensors "
                         f"checkpoints are not read")
    groups = q.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ValueError(f"{source}: compressed-tensors quantization_config needs a non-empty config_groups object, "
                         f"got {groups!r}")
    for name, group in groups.items():
        if not isinstance(group, dict):
            raise ValueError(f"{source}: quantization_config config_groups[{name!r}] must be an object, got {group!r}")
        fmt = group.get("format") or q.get("format")
        if fmt != "float-quantized":
            raise ValueError(f"{source}: quantization_config config_groups[{name!r}] has format {fmt!r}; moeshard "
                             f"reads 'float-quantized' (e4m3 weights with their scales) only")
        _check_scheme(name, "weights", group.get("weights"), ("tensor", "channel"), source)
        if group.get("input_activations") is not None:
            _check_scheme(name, "input_activations", group["input_activations"], ("tensor", "token"), source)
    return True


@dataclass(frozen=True)
class CheckpointFormat:
    """How a checkpoint stores its weights.

    name: ``bf16`` (full precision: fp32 / bf16 / fp16 tensors) or a quantized format.
    stored_scheme: None for full precision (the experts load as any requested scheme), else the
      moeshard scheme the stored experts are read as, without requantizing (``fp8_block``,
      ``fp8_token``).
    detect: ``(quantization_config or None, source) -> bool``: whether config.json describes
      this format; raises ValueError (naming the field and value) for a near miss.
    summary: one line for messages, with its article ("an FP8 block checkpoint (...)").
    dequantized: the routed experts are stored in a quantized form that the reader dequantizes
      to the model dtype as it reads them (``mxfp4``); they then load as any requested scheme,
      as a full-precision checkpoint's do (``stored_scheme`` None).
    weight_scales: how its quantized weights' scales are stored: ``"block"`` (``weight_scale_inv``, or
      DeepSeek-V4's ``scale``, [ceil(R/128), ceil(C/128)], one per 128 x 128 tile; the dense
      weights of ``fp8_block_mxfp4`` too, whose experts ``checkpoint.fp8_block_mxfp4`` reads),
      ``"row"`` (``weight_scale`` of shape [] or [1]: one for the tensor, or [R] / [R, 1]: one
      per output row), ``"mx"`` (uint8 E8M0 exponents [..., C / 32], one per 32 values of a
      row: ``checkpoint.mxfp8``), ``"nvfp4"`` (the weights are uint8 e2m1 pairs, their scales
      e4m3 ``weight_scale`` [R, C / 16] and fp32 ``weight_scale_2``:
      ``checkpoint.nvfp4_modelopt``), None (no e4m3 weights).
    also_stored_as: further schemes the stored experts are read as without requantizing, where
      their scales allow it (``fp8_tensor`` from ``"row"`` scales: one scale for each expert
      weight, the gate's equal to the up's); the reader refuses, naming the tensors, where not.
    """

    name: str
    stored_scheme: str | None
    detect: Callable[[Any, str], bool]
    summary: str
    dequantized: bool = False
    weight_scales: str | None = None
    also_stored_as: tuple[str, ...] = ()

    @property
    def stored_schemes(self) -> tuple[str, ...]:
        """Every scheme the experts load as without requantizing (the default first); () for full
        precision and dequantized formats, whose experts load as any scheme."""
        return () if self.stored_scheme is None else (self.stored_scheme, *self.also_stored_as)


_PER_ROW = ("float8_e4m3fn weight + weight_scale, one per tensor or per output row (w = q * scale); its static "
            "input_scale is not used (activations are quantized dynamically)")

CHECKPOINT_FORMATS: dict[str, CheckpointFormat] = {fmt.name: fmt for fmt in (
    CheckpointFormat("bf16", None, _is_full_precision,
                     "a full-precision checkpoint (fp32 / bf16 / fp16 tensors, no quantization_config)"),
    CheckpointFormat("fp8_block", "fp8_block", _is_fp8_block,
                     "an FP8 block checkpoint (DeepSeek-V3 style: float8_e4m3fn weight + weight_scale_inv per "
                     "128 x 128 block; quantization_config quant_method 'fp8', weight_block_size [128, 128], "
                     "dynamic activations)", weight_scales="block"),
    CheckpointFormat("modelopt_fp8", "fp8_token", _is_modelopt_fp8,
                     "an NVIDIA ModelOpt FP8 checkpoint (quantization_config quant_method 'modelopt', quant_algo "
                     f"{' or '.join(MODELOPT_FP8_ALGOS)}; {_PER_ROW})",
                     weight_scales="row", also_stored_as=("fp8_tensor",)),
    CheckpointFormat("compressed_fp8", "fp8_token", _is_compressed_fp8,
                     "a compressed-tensors FP8 checkpoint (quantization_config quant_method 'compressed-tensors', "
                     f"format 'float-quantized', 8-bit float weights; {_PER_ROW})",
                     weight_scales="row", also_stored_as=("fp8_tensor",)),
    CheckpointFormat("modelopt_nvfp4", None, _is_modelopt_nvfp4,
                     "an NVIDIA ModelOpt NVFP4 checkpoint (quantization_config quant_method 'modelopt', quant_algo "
                     "NVFP4, group_size 16: uint8 weight, two e2m1 values a byte, float8_e4m3fn weight_scale per 16 "
                     "values and fp32 weight_scale_2; per-expert tensors); its weights are dequantized to the model "
                     "dtype as they are read", dequantized=True, weight_scales="nvfp4"),
    CheckpointFormat("mxfp4", None, _is_mxfp4,
                     "an MXFP4 checkpoint (gpt-oss style: routed experts as <name>_blocks, two e2m1 values a byte, "
                     "and <name>_scales, one e8m0 exponent per 32 values; quantization_config quant_method "
                     "'mxfp4'); its experts are dequantized to the model dtype as they are read", dequantized=True),
    CheckpointFormat("mxfp8", None, _is_mxfp8,
                     "an MXFP8 checkpoint (Inkling 2 style: float8_e4m3fn weights with one E8M0 exponent byte per "
                     "32 values of a row, <name>_scale; quantization_config quant_method 'mxfp8', weight_block_size "
                     "[1, 32], scale_fmt 'ue8m0'); its weights are dequantized to the model dtype as they are read",
                     dequantized=True, weight_scales="mx"),
    CheckpointFormat("fp8_block_mxfp4", None, _is_fp8_block_mxfp4,
                     "an FP8 block checkpoint with FP4 experts (DeepSeek-V4 style: float8_e4m3fn dense weights with a "
                     "UE8M0 scale per 128 x 128 block, <module>.scale; routed experts per expert as int8 weights, two "
                     "e2m1 values a byte, with a UE8M0 scale per 32 values of a row; quantization_config quant_method "
                     "'fp8', weight_block_size [128, 128], scale_fmt 'ue8m0', expert_dtype 'fp4'); its weights are "
                     "dequantized to the model dtype as they are read", dequantized=True, weight_scales="block"),
)}
