"""DeepSeek-V4's FP8 release (quantization_config quant_method ``fp8``, weight_block_size [128, 128],
scale_fmt ``ue8m0``, expert_dtype ``fp4``): FP8 dense weights with a UE8M0 scale per 128 x 128 block
and FP4 routed experts with one per 32 values, all dequantized to the model dtype as they are read
(``checkpoint.fp8_block_mxfp4``, format ``fp8_block_mxfp4``).

The checkpoint is written from a tiny random DeepSeek-V4 model (``make_tiny_moe``) by this test's
own quantizer, under the release's flat names (``layers.{L}.ffn.experts.{e}.w1.weight``,
``embed.weight``, ``head.weight``, ``hc_head_fn``): every routed expert's ``w1`` / ``w3`` / ``w2``
as int8 e2m1 pairs with float8_e8m0fnu exponents under ``<module>.scale``, and the shared experts'
and three attention projections as e4m3 with a UE8M0 block scale, beside an oracle holding the values they
dequantize to as full-precision tensors, which transformers loads itself. The intermediate size
(96) leaves TP2's slices (48 columns) inside 32-column blocks of down, so a rank reads and cuts a
partial block. Proved:

- hand-computed dequantization (nibble order, exponents), and the refusals of a NaN exponent and
  of mismatched dtypes or shapes;
- the format read from config.json, and refused by name for another block size, activation
  scheme or scale format (a family without it refuses it by name: tests/test_checkpoint.py);
- greedy ids and logits at (1,1), EP2 and TP2 against transformers on the oracle;
- moeshard's own ``--compare`` model of the checkpoint is transformers on those very values;
- planted faults: the exponents read one off, and the nibbles of a byte swapped;
- a missing or misshapen scale named; scales under transformers' ``weight_scale_inv``, and the
  experts' as uint8 bytes, read too;
- the same release with FP8 experts (expert_dtype ``fp8``, UE8M0 or fp32 block scales under
  ``.scale``) read as ``fp8_block`` as stored;
- training's save of a model read from it is a full-precision checkpoint.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers as tf
from quantized_checkpoints import (  # make_tiny_moe: a script of this repository, which it puts on the path
    AgainstTransformers,
    assert_saves_as_full_precision,
    judge,
    make_tiny_moe,
    oracle_generations,
    save_beside,
)
from safetensors.torch import load_file, save_file

from moeshard.checkpoint import read_hf_config
from moeshard.checkpoint.fp8_block_mxfp4 import dequantize_fp4
from moeshard.checkpoint.hf_config import parse_hf_config
from moeshard.checkpoint.mxfp4 import E2M1
from moeshard.jobs.generate import GenerateSpec, compare_generations, generate_rank, plan_generate
from moeshard.parallel.config import ParallelConfig

FAMILY = "deepseek_v4"
PROMPTS = ((3, 17, 42, 5, 9), (1, 2, 3), (7, 8, 9, 10))
NEW_TOKENS = 3
H, I, E, LAYERS = 64, 96, 4, 2
QUANTIZATION = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], "scale_fmt": "ue8m0",
                "activation_scheme": "dynamic", "expert_dtype": "fp4"}
E4M3_MAX, E2M1_MAX = 448.0, 6.0
E8M0 = torch.float8_e8m0fnu
# The dense weights the test quantizes to FP8: the shared experts and three attention projections
# (wo_a: the grouped output projection, one weight [o_groups * o_lora_rank, ...]).
DENSE = ("ffn.shared_experts.w1.weight", "ffn.shared_experts.w2.weight", "ffn.shared_experts.w3.weight",
         "attn.wq_a.weight", "attn.wo_a.weight", "attn.wo_b.weight")


def _power_of_two_scale(amax: torch.Tensor, top: float) -> torch.Tensor:
    """The exponent of the smallest power of two that brings ``amax`` within ``top``."""
    return torch.ceil(torch.log2(amax.clamp(min=2.0**-100) / top)).to(torch.int32)


def quantize_fp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [R, C] -> (int8 [R, C / 2] e2m1 pairs, even column in the low nibble; float8_e8m0fnu
    exponents [R, C / 32]): each 32-value block scaled by a power of two into e2m1's range and
    rounded to the nearest e2m1 value."""
    blocks = w.float().unflatten(-1, (-1, 32))
    exponent = _power_of_two_scale(blocks.abs().amax(-1), E2M1_MAX)
    scaled = torch.ldexp(blocks, -exponent.unsqueeze(-1)).flatten(-2)
    grid = torch.tensor(E2M1[:8])
    code = (scaled.abs().unsqueeze(-1) - grid).abs().argmin(-1) + 8 * (scaled < 0)
    pairs = (code[..., 0::2] | (code[..., 1::2] << 4)).to(torch.uint8)
    return pairs.view(torch.int8), (exponent + 127).to(torch.uint8).view(E8M0)


def quantize_fp8_block(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [R, C] -> (e4m3 [R, C], float8_e8m0fnu [ceil(R/128), ceil(C/128)]): a power-of-two scale per
    128 x 128 tile."""
    rows, cols = w.shape
    br, bc = -(-rows // 128), -(-cols // 128)
    padded = torch.zeros(br * 128, bc * 128)
    padded[:rows, :cols] = w.float()
    tiles = padded.unflatten(0, (br, 128)).unflatten(2, (bc, 128))  # [br, 128, bc, 128]
    exponent = _power_of_two_scale(tiles.abs().amax(dim=(1, 3)), E4M3_MAX)
    q = torch.ldexp(tiles, -exponent[:, None, :, None]).flatten(0, 1).flatten(1, 2)[:rows, :cols]
    return q.to(torch.float8_e4m3fn), (exponent + 127).to(torch.uint8).view(E8M0)


def dequantize_fp8_block(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    full = scale.float().repeat_interleave(128, 0).repeat_interleave(128, 1)[:q.shape[0], :q.shape[1]]
    return (q.float() * full).to(dtype)


def _expert(name: str) -> bool:
    return ".ffn.experts." in name and name.endswith((".w1.weight", ".w2.weight", ".w3.weight"))


# transformers' saves -> the release's flat namespace (its decoder layers, embedding, norm and head).
FLAT = (("model.layers.", "layers."), ("model.embed_tokens.", "embed."), ("model.norm.", "norm."),
        ("model.hc_head.hc_", "hc_head_"))


def flat(name: str) -> str:
    """The release's name of the tensor transformers saves as ``name``."""
    return next((stored + name[len(saved):] for saved, stored in FLAT if name.startswith(saved)), name)


def _write(src: Path, out: tuple[Path, Path], experts: str = "fp4",
           block_scales: torch.dtype = E8M0) -> tuple[Path, Path]:
    """The release of the tiny model ``src`` (its experts FP4, or FP8 with block scales), under the
    release's flat names, its 128 x 128 block scales stored as ``block_scales`` (UE8M0; -Base
    releases: fp32), and its oracle, as transformers saved it, at ``out``."""
    tensors = load_file(src / "model.safetensors")
    routed = [n for n in tensors if _expert(n)]
    dense = [n for n in tensors if n.endswith(DENSE)]
    assert len(routed) == 3 * E * LAYERS and len(dense) == len(DENSE) * LAYERS, (routed, dense)
    release, oracle = dict(tensors), dict(tensors)
    for name in routed + dense:
        scale = name[: -len("weight")] + "scale"
        if name in routed and experts == "fp4":
            release[name], release[scale] = quantize_fp4(tensors[name])
            oracle[name] = dequantize_fp4(release[name], release[scale], tensors[name].dtype)
        else:
            release[name], exponents = quantize_fp8_block(tensors[name])
            release[scale] = exponents.to(block_scales)  # powers of two: exact in fp32
            oracle[name] = dequantize_fp8_block(release[name], release[scale], tensors[name].dtype)
    config = json.loads((src / "config.json").read_text())
    save_beside(src, out[0], {flat(name): t for name, t in release.items()},
                {**config, "quantization_config": {**QUANTIZATION, "expert_dtype": experts}})
    save_beside(src, out[1], oracle, config)
    return out


def _tiny(root: Path, inter: int = I) -> Path:
    if FAMILY not in tf.models.auto.configuration_auto.CONFIG_MAPPING_NAMES:
        pytest.skip(f"transformers {tf.__version__} has no DeepSeek-V4")
    make_tiny_moe.make(str(root / "src"), FAMILY, hidden=H, moe_intermediate=inter, experts=E, layers=LAYERS, vocab=64,
                       seed=3)
    return root / "src"


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> tuple[Path, Path]:
    """(the FP8 release with FP4 experts, its oracle)."""
    root = tmp_path_factory.mktemp("fp8-fp4")
    return _write(_tiny(root), (root / "release", root / "oracle"))


def _plan(model_dir: Path, layout: ParallelConfig | None = None, compare: bool = True, quant: str | None = None):
    return plan_generate(GenerateSpec(str(model_dir), PROMPTS, NEW_TOKENS, layout or ParallelConfig(), dtype="float32",
                                      compare=compare, **({"quant": quant} if quant else {})))


# -- hand-computed -----------------------------------------------------------------------------
def test_dequantization_by_hand():
    # Bytes: low nibble first. 0x21 -> 0.5 (code 1), 1.0 (code 2); 0xF7 -> 6.0 (code 7), -6.0 (code 15);
    # 0x9B -> -1.5 (code 11), -0.5 (code 9); 0x00 -> 0, 0.
    row = [0x21, 0xF7, 0x9B, 0x00] * 4
    packed = torch.tensor([row + row], dtype=torch.uint8).view(torch.int8)  # [1, 32]: 64 values, two blocks
    scales = torch.tensor([[128, 125]], dtype=torch.uint8).view(E8M0)  # 2^1, then 2^-2
    block = [0.5, 1.0, 6.0, -6.0, -1.5, -0.5, 0.0, 0.0] * 4
    want = torch.tensor([[v * 2 for v in block] + [v / 4 for v in block]])
    assert torch.equal(dequantize_fp4(packed, scales, torch.float32), want)
    assert torch.equal(dequantize_fp4(packed, scales.view(torch.uint8), torch.bfloat16), want.to(torch.bfloat16))


@pytest.mark.parametrize("packed, scales, message", [
    (torch.zeros(2, 32, dtype=torch.float16), torch.zeros(2, 2, dtype=torch.uint8), "must be int8 or uint8"),
    (torch.zeros(2, 32, dtype=torch.int8), torch.zeros(2, 2), "must be int8 or uint8 and its scales float8_e8m0fnu"),
    (torch.zeros(2, 24, dtype=torch.int8), torch.zeros(2, 1, dtype=torch.uint8), r"C a multiple of 32"),
    (torch.zeros(2, 32, dtype=torch.int8), torch.zeros(2, 3, dtype=torch.uint8), r"got \[2, 32\] and \[2, 3\]"),
    (torch.zeros(2, 32, dtype=torch.int8), torch.tensor([[127, 127], [255, 127]], dtype=torch.uint8),
     r"scale \[1, 0\] is 255, E8M0's NaN"),
])
def test_bad_values_or_scales_are_refused(packed, scales, message):
    with pytest.raises(ValueError, match=message):
        dequantize_fp4(packed, scales, torch.float32, "w")


def test_the_test_quantizers_round_trip_exactly_representable_weights():
    """The writer's own quantizers: weights that are e2m1 (e4m3) values times a power of two per
    block come back exactly, so the oracle's values are the quantizer's, not an approximation."""
    grid = torch.tensor(E2M1)
    w = grid[torch.randint(0, 16, (4, 64), generator=torch.Generator().manual_seed(0))] * 2.0 ** -3
    w[:, :32] *= 8  # another scale in the first block
    assert torch.equal(dequantize_fp4(*quantize_fp4(w), torch.float32), w)
    d = torch.randn(130, 70, generator=torch.Generator().manual_seed(1)).to(torch.float8_e4m3fn).float() * 2.0 ** -5
    assert torch.equal(dequantize_fp8_block(*quantize_fp8_block(d), torch.float32), d)


# -- the format --------------------------------------------------------------------------------
def _raw(**quantization):
    return dict(model_type=FAMILY, hidden_size=H, moe_intermediate_size=I, num_hidden_layers=2, n_routed_experts=E,
                num_experts_per_tok=2, scoring_func="sqrtsoftplus", hidden_act="silu", swiglu_limit=10.0,
                quantization_config={**QUANTIZATION, **quantization})


def test_the_format_is_read_from_the_config():
    info = parse_hf_config(_raw(), "config.json")
    assert info.checkpoint_format == "fp8_block_mxfp4" and info.format.dequantized and info.format.stored_schemes == ()
    # With FP8 experts the same release is an FP8 block checkpoint, read as stored.
    assert parse_hf_config(_raw(expert_dtype="fp8"), "config.json").checkpoint_format == "fp8_block"
    # The release states expert_dtype at the top level, outside quantization_config, as transformers
    # also reads it; a value inside quantization_config wins.
    q = {k: v for k, v in QUANTIZATION.items() if k != "expert_dtype"}
    top = {**_raw(), "quantization_config": q, "expert_dtype": "fp4"}
    assert parse_hf_config(top, "config.json").checkpoint_format == "fp8_block_mxfp4"
    assert parse_hf_config({**top, "expert_dtype": "fp8"}, "config.json").checkpoint_format == "fp8_block"
    assert parse_hf_config({**top, "quantization_config": {**q, "expert_dtype": "fp8"}},
                           "config.json").checkpoint_format == "fp8_block"


@pytest.mark.parametrize("field, value, message", [
    ("weight_block_size", [1, 32], r"weight_block_size=\[1, 32\]; moeshard's fp8_block needs \[128, 128\]"),
    ("scale_fmt", "float", r"expert_dtype='fp4' has scale_fmt='float'; moeshard reads FP4 experts with "
                           r"scale_fmt='ue8m0'"),
    ("activation_scheme", "static", r"activation_scheme='static'"),
])
def test_other_configs_are_refused_naming_the_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        parse_hf_config(_raw(**{field: value}), "config.json")


# -- whole model against transformers -----------------------------------------------------------
@pytest.fixture(scope="module")
def oracles(ckpts):
    """DP size -> transformers' own generation on the oracle (each DP rank its share of prompts)."""
    get = oracle_generations(_plan)
    return lambda dp=1: get(ckpts[1], dp)


def test_the_checkpoint_is_read_as_fp8_block_mxfp4(ckpts):
    info = read_hf_config(ckpts[0])
    assert (info.model_type, info.checkpoint_format, info.moe.intermediate_size) == (FAMILY, "fp8_block_mxfp4", I)


class TestReleaseAgainstTransformers(AgainstTransformers):
    plan = staticmethod(_plan)


@pytest.mark.parametrize("fault", ["exponent", "nibbles"])
def test_planted_faults_are_seen(ckpts, oracles, monkeypatch, fault):
    """The experts' exponents read one too high, or each byte's two values swapped: the logits move."""
    from moeshard.checkpoint import fp8_block_mxfp4

    real = fp8_block_mxfp4.dequantize_mxfp4
    if fault == "exponent":
        monkeypatch.setattr(fp8_block_mxfp4, "dequantize_mxfp4", lambda b, s, d: real(b, s + 1, d))
    else:
        monkeypatch.setattr(fp8_block_mxfp4, "dequantize_mxfp4", lambda b, s, d: real((b << 4) | (b >> 4), s, d))
    plan = _plan(ckpts[0])
    c = compare_generations(plan, [generate_rank(plan, None)], oracles())
    seen = [d for d in c.step_max_abs if d is not None]
    assert not all(c.same_ids) or max(seen) > 1e-3, c


def _edited(ckpts, tmp_path: Path, edit) -> Path:
    tensors = load_file(ckpts[0] / "model.safetensors")
    edit(tensors)
    out = tmp_path / "edited"
    shutil.copytree(ckpts[0], out)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("edit, message", [
    ("drop", r"ffn\.experts\.1\.w3\.scale' is missing"),
    ("shape", r"ffn\.experts\.0\.w2\.scale' in .* has shape \[64, 1\], expected \[64, 3\]"),
    ("dense", r"attn\.wq_a\.weight_scale_inv' is missing"),
])
def test_a_missing_or_misshapen_scale_is_refused_naming_it(ckpts, tmp_path, edit, message):
    def change(tensors):
        if edit == "drop":
            del tensors["layers.1.ffn.experts.1.w3.scale"]
        elif edit == "shape":
            name = "layers.0.ffn.experts.0.w2.scale"
            tensors[name] = tensors[name][:, :1].contiguous()
        else:
            del tensors["layers.0.attn.wq_a.scale"]

    broken = _edited(ckpts, tmp_path, change)
    with pytest.raises(ValueError, match=message):
        generate_rank(_plan(broken), None)


def test_scales_under_transformers_names_and_as_bytes_are_read_too(ckpts, oracles, tmp_path):
    """transformers names a scale ``weight_scale_inv``, and a writer may keep the experts' E8M0
    exponents as uint8 bytes (as MXFP8 checkpoints do): the same release with every scale so named,
    the experts' as bytes, reads to the same model."""
    def change(tensors):
        for name in [n for n in tensors if n.endswith(".scale") and tensors[n].dtype == E8M0]:
            scale = tensors.pop(name)
            tensors[name[: -len("scale")] + "weight_scale_inv"] = scale.view(torch.uint8) if _expert(name[:-5] + "weight") \
                else scale

    plan = _plan(_edited(ckpts, tmp_path, change))
    judge(plan, [generate_rank(plan, None)], oracles(), "weight_scale_inv, uint8")


@pytest.mark.parametrize("block_scales", [E8M0, torch.float32], ids=["ue8m0", "fp32"])
def test_fp8_experts_read_as_fp8_block_as_stored(tmp_path, block_scales):
    """expert_dtype ``fp8``: an FP8 block checkpoint whose block scales (UE8M0, or fp32 as
    DeepSeek-V4-Flash-Base stores them) are stored under ``.scale``. As ``fp8_block`` the experts
    are the stored e4m3 codes and scales, not requantized; as ``none`` the model's logits equal
    transformers' on the dequantized values (transformers itself reads this format only with the
    accelerate package)."""
    from moeshard.checkpoint.experts import ExpertReader
    from moeshard.checkpoint.names import resolve_block_names
    from moeshard.checkpoint.reader import SafetensorsCheckpoint
    from moeshard.config import QuantConfig
    from moeshard.integrations.transformers import load_sharded_model
    from moeshard.sharding import ShardSpec

    # I = 128: per-expert gate and up tiles join into one fp8_block weight on a tile boundary.
    release, oracle = _write(_tiny(tmp_path, inter=128), (tmp_path / "fp8", tmp_path / "fp8-oracle"), experts="fp8",
                             block_scales=block_scales)
    info = read_hf_config(release)
    assert info.checkpoint_format == "fp8_block"
    ckpt = SafetensorsCheckpoint(release)
    stored = load_file(release / "model.safetensors")
    weights = ExpertReader(ckpt, resolve_block_names(ckpt, info, 1), info.moe_config(), info.format).read(
        QuantConfig("fp8_block"), ShardSpec(0, E))
    prefix = "layers.1.ffn.experts.2."
    codes = torch.cat([stored[prefix + "w1.weight"], stored[prefix + "w3.weight"]])
    assert torch.equal(weights.gate_up.data[2].view(torch.uint8), codes.view(torch.uint8))
    assert torch.equal(weights.down.scale[2], stored[prefix + "w2.scale"].float())
    ids = torch.tensor([list(PROMPTS[0])])
    with torch.no_grad():
        got = load_sharded_model(release, quant="none", dtype="float32")(ids).logits
        want = tf.AutoModelForCausalLM.from_pretrained(oracle, dtype=torch.float32)(ids).logits
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()


def test_a_model_read_dequantized_saves_as_full_precision(ckpts, tmp_path):
    """Training's save of a model read from the release: a model-dtype checkpoint without its
    quantization_config, which reads back to the same logits."""
    assert_saves_as_full_precision(ckpts[0], tmp_path / "saved", PROMPTS[0])
