"""MXFP8 checkpoints (quantization_config quant_method ``mxfp8``; Inkling 2's MXFP8 release): e4m3
weights with one E8M0 exponent byte per 32 values of a row, dequantized to the model dtype as they
are read (``checkpoint.mxfp8``).

The checkpoint is written from a tiny random Inkling 2 model (``make_tiny_moe``: the release's
names, gate_up interleaved) by this test's own quantizer: the routed experts (``w13_weight``,
``w2_weight``) and one attention projection (a dense weight) as e4m3 values and exponents, beside
an oracle holding q * 2^(s - 127) as full-precision tensors, which transformers loads itself. The
intermediate size (96) leaves TP2's slices (48 columns) inside 32-column blocks of down, so a
rank reads and cuts a partial block. Proved:

- hand-computed dequantization, and the refusals of a NaN exponent and of mismatched shapes;
- the format read from config.json, and refused by name for another block, scale format or
  expert dtype;
- greedy ids and logits at (1,1), EP2 and TP2 against transformers on the oracle;
- moeshard's own ``--compare`` model of the MXFP8 checkpoint is transformers on those very values;
- planted faults: the exponents read one off, and the experts read without the interleave;
- scales under transformers' own ``_scale_inv`` names, and the loop model's checkpoint.
"""

from __future__ import annotations

import json
import shutil
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import transformers as tf
from quantized_checkpoints import (
    AgainstTransformers,
    assert_saves_as_full_precision,
    judge,
    oracle_generations,
    save_beside,
)
from safetensors.torch import load_file, save_file

from moeshard.checkpoint import read_hf_config
from moeshard.checkpoint.families import FAMILIES
from moeshard.checkpoint.hf_config import parse_hf_config
from moeshard.checkpoint.mxfp8 import dequantize_mxfp8
from moeshard.jobs.generate import GenerateSpec, compare_generations, generate_rank, plan_generate, reference_generate
from moeshard.parallel.config import ParallelConfig

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import make_tiny_moe  # noqa: E402 - a script of this repository, importable once its directory is on the path

FAMILY = "inkling2_text"
PROMPTS = ((3, 17, 42, 5, 9), (1, 2, 3), (7, 8, 9, 10))
NEW_TOKENS = 3
H, I, LAYERS = 64, 96, 2
QUANTIZATION = {"quant_method": "mxfp8", "weight_block_size": [1, 32], "scale_fmt": "ue8m0",
                "activation_scheme": "dynamic"}
E4M3_MAX = 448.0


def quantize_mxfp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., K] -> (e4m3 values [..., K], uint8 exponents [..., K / 32]): each block's scale the
    smallest power of two that brings its amax within e4m3's 448."""
    blocks = w.float().unflatten(-1, (-1, 32))
    amax = blocks.abs().amax(-1).clamp(min=2.0**-100)
    exponent = torch.ceil(torch.log2(amax / E4M3_MAX)).to(torch.int32)
    q = torch.ldexp(blocks, -exponent.unsqueeze(-1)).to(torch.float8_e4m3fn)
    return q.flatten(-2), (exponent + 127).to(torch.uint8)


def _quantized(name: str) -> bool:
    return name.endswith(("mlp.experts.w13_weight", "mlp.experts.w2_weight")) or name.endswith("attn.wq_du.weight")


def _write(src: Path, out: tuple[Path, Path], layers: int) -> tuple[Path, Path]:
    """The MXFP8 checkpoint of the tiny model ``src`` and its oracle, at ``out``."""
    tensors = load_file(src / "model.safetensors")
    chosen = [n for n in tensors if _quantized(n)]
    assert len(chosen) == 3 * layers, chosen
    mx, oracle = dict(tensors), dict(tensors)
    for name in chosen:
        q, s = quantize_mxfp8(tensors[name])
        mx[name], mx[name + "_scale"] = q, s
        oracle[name] = dequantize_mxfp8(q, s, tensors[name].dtype)
    config = json.loads((src / "config.json").read_text())
    save_beside(src, out[0], mx, {**config, "quantization_config": QUANTIZATION})
    save_beside(src, out[1], oracle, config)
    return out


def _skip_without_inkling2() -> None:
    if FAMILY not in tf.models.auto.configuration_auto.CONFIG_MAPPING_NAMES:
        pytest.skip(f"transformers {tf.__version__} has no Inkling 2")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> tuple[Path, Path]:
    """(the MXFP8 checkpoint, its oracle)."""
    _skip_without_inkling2()
    root = tmp_path_factory.mktemp("mxfp8")
    make_tiny_moe.make(str(root / "src"), FAMILY, hidden=H, moe_intermediate=I, experts=8, layers=LAYERS, seed=5)
    return _write(root / "src", (root / "mxfp8", root / "oracle"), LAYERS)


def _plan(model_dir: Path, layout: ParallelConfig | None = None):
    return plan_generate(GenerateSpec(str(model_dir), PROMPTS, NEW_TOKENS, layout or ParallelConfig(), dtype="float32",
                                      compare=True))


# -- hand-computed -----------------------------------------------------------------------------
def test_dequantization_by_hand():
    values = torch.tensor([[1.0, -0.5, 448.0, 0.0] * 8 + [3.0, -1.5, 0.125, 2.0] * 8]).to(torch.float8_e4m3fn)
    scales = torch.tensor([[128, 120]], dtype=torch.uint8)  # 2^1, then 2^-7
    got = dequantize_mxfp8(values, scales, torch.float32)
    want = torch.tensor([[2.0, -1.0, 896.0, 0.0] * 8 + [3 / 128, -1.5 / 128, 0.125 / 128, 2 / 128] * 8])
    assert torch.equal(got, want)
    assert torch.equal(dequantize_mxfp8(values, scales, torch.bfloat16), want.to(torch.bfloat16))


@pytest.mark.parametrize("values, scales, message", [
    (torch.zeros(2, 64), torch.zeros(2, 2, dtype=torch.uint8), "must be float8_e4m3fn and scales uint8"),
    (torch.zeros(2, 48), torch.zeros(2, 1, dtype=torch.uint8), r"K a multiple of 32"),
    (torch.zeros(2, 64), torch.zeros(2, 3, dtype=torch.uint8), r"got \[2, 64\] and \[2, 3\]"),
    (torch.zeros(2, 64), torch.tensor([[127, 127], [127, 255]], dtype=torch.uint8), r"scale \[1, 1\] is 255, E8M0's NaN"),
])
def test_bad_values_or_scales_are_refused(values, scales, message):
    if values.dtype == torch.float32 and "uint8" not in message:
        values = values.to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=message):
        dequantize_mxfp8(values, scales, torch.float32, "w")


# -- the format --------------------------------------------------------------------------------
def _raw(**quantization):
    return dict(model_type=FAMILY, hidden_size=H, moe_intermediate_size=I, num_hidden_layers=2, n_routed_experts=4,
                num_experts_per_tok=2, quantization_config={**QUANTIZATION, **quantization})


def test_the_format_is_read_from_the_config():
    info = parse_hf_config(_raw(), "config.json")
    assert info.checkpoint_format == "mxfp8" and info.format.dequantized and info.format.stored_schemes == ()


@pytest.mark.parametrize("field, value, message", [
    ("weight_block_size", [128, 128], r"weight_block_size=\[128, 128\]; MXFP8 scales cover \[1, 32\] blocks"),
    ("scale_fmt", "float", r"scale_fmt='float'; moeshard reads scale_fmt='ue8m0' only"),
    ("expert_dtype", "fp4", r"expert_dtype='fp4'"),
    ("activation_scheme", "static", r"activation_scheme='static'"),
])
def test_other_mxfp8_configs_are_refused_naming_the_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        parse_hf_config(_raw(**{field: value}), "config.json")


def test_a_family_without_the_format_refuses_it():
    raw = dict(model_type="qwen3_moe", hidden_size=64, moe_intermediate_size=32, num_hidden_layers=2,
               num_experts=4, num_experts_per_tok=2, intermediate_size=64, quantization_config=QUANTIZATION)
    with pytest.raises(ValueError, match=r"quant_method=.mxfp8. is not supported for model_type .qwen3_moe."):
        parse_hf_config(raw, "config.json")


# -- whole model against transformers -----------------------------------------------------------
@pytest.fixture(scope="module")
def oracles(ckpts):
    """DP size -> transformers' own generation on the oracle (each DP rank its share of prompts)."""
    get = oracle_generations(_plan)
    return lambda dp=1: get(ckpts[1], dp)


def test_the_checkpoint_is_read_as_mxfp8(ckpts):
    info = read_hf_config(ckpts[0])
    assert (info.model_type, info.checkpoint_format, info.moe.intermediate_size) == (FAMILY, "mxfp8", I)


class TestMXFP8AgainstTransformers(AgainstTransformers):
    plan = staticmethod(_plan)


@pytest.mark.parametrize("fault", ["exponent", "interleave"])
def test_planted_faults_are_seen(ckpts, oracles, monkeypatch, fault):
    """The exponents read one too high, or the experts read as gate rows first: the logits move."""
    if fault == "exponent":
        from moeshard.checkpoint import experts

        real = experts.dequantize_mxfp8
        monkeypatch.setattr(experts, "dequantize_mxfp8", lambda v, s, d, n="": real(v, s + 1, d, n))
    else:
        monkeypatch.setitem(FAMILIES, FAMILY, replace(FAMILIES[FAMILY], checkpoint_fused_layout=None))
    plan = _plan(ckpts[0])
    c = compare_generations(plan, [generate_rank(plan, None)], oracles())
    seen = [d for d in c.step_max_abs if d is not None]
    assert not all(c.same_ids) or max(seen) > 1e-3, c


@pytest.mark.parametrize("edit, message", [
    ("drop", r"mlp\.experts\.w13_weight_scale.* is missing"),
    ("shape", r"mlp\.experts\.w2_weight_scale"),
])
def test_a_missing_or_misshapen_scale_is_refused_naming_it(ckpts, tmp_path, edit, message):
    tensors = load_file(ckpts[0] / "model.safetensors")
    target = next(n for n in tensors if n.endswith("w13_weight_scale" if edit == "drop" else "w2_weight_scale"))
    if edit == "drop":
        del tensors[target]
    else:
        tensors[target] = tensors[target][:, :, :1].contiguous()
    broken = tmp_path / "broken"
    shutil.copytree(ckpts[0], broken)
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=message):
        generate_rank(_plan(broken), None)


def test_a_model_read_dequantized_saves_as_full_precision(ckpts, tmp_path):
    """Training's save of a model read from an MXFP8 checkpoint: a model-dtype checkpoint without
    the source's quantization_config, which reads back to the same logits."""
    assert_saves_as_full_precision(ckpts[0], tmp_path / "saved", PROMPTS[0])


def test_scales_under_transformers_own_names_are_read_too(ckpts, oracles, tmp_path):
    """transformers' FineGrainedFP8 names a scale ``<name>_scale_inv``: the same checkpoint with
    every scale so named reads to the same model."""
    tensors = load_file(ckpts[0] / "model.safetensors")
    renamed = {(n + "_inv" if n.endswith("_scale") else n): t for n, t in tensors.items()}
    assert sum(n.endswith("_scale_inv") for n in renamed) == 3 * LAYERS
    other = tmp_path / "scale_inv"
    shutil.copytree(ckpts[0], other)
    save_file(renamed, str(other / "model.safetensors"), metadata={"format": "pt"})
    plan = _plan(other)
    judge(plan, [generate_rank(plan, None)], oracles(), "_scale_inv")


def test_the_loop_model_reads_mxfp8_too(tmp_path):
    """Inkling 2's loop model (``inkling2_loop_text``) shares the format: (1,1) against transformers
    on its oracle."""
    _skip_without_inkling2()
    loop, layers = "inkling2_loop_text", 4
    make_tiny_moe.make(str(tmp_path / "src"), loop, hidden=H, moe_intermediate=I, experts=8, layers=layers, seed=6)
    mx, oracle = _write(tmp_path / "src", (tmp_path / "mxfp8", tmp_path / "oracle"), layers)
    assert read_hf_config(mx).checkpoint_format == "mxfp8"
    plan = _plan(mx)
    c = compare_generations(plan, [generate_rank(plan, None)], reference_generate(_plan(oracle)),
                            reference_generate(_plan(oracle), dtype=torch.float64))
    assert all(c.same_ids), f"ids differ at steps {c.first_difference}"
    assert c.within_tolerance or c.within_noise, f"logits off by {c.step_max_abs}, its rounding {c.dtype_noise}"
