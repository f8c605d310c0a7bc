"""NVIDIA ModelOpt NVFP4 checkpoints (quant_algo NVFP4): uint8 weights of e2m1 pairs, an e4m3 scale
per 16 values and an fp32 global scale per weight, dequantized to the model dtype as they are read
(``checkpoint.nvfp4_modelopt``).

Each checkpoint is written from a tiny random model by this test's own quantizer: every linear
weight (routers, norms, embeddings and lm_head stay float; Nemotron-H's attention too, as NVIDIA's
recipe leaves it) as packed codes with its two scales, beside an oracle of full-precision tensors
holding (e2m1 value * scale) * global scale, computed from the quantizer's values before packing,
which transformers loads itself. The moe intermediate sizes (48, and Nemotron-H's 96) put TP2's
slice boundary inside a 16-column group of down, so a rank reads and cuts a partial group.
Proved:

- hand-computed dequantization (the nibble order, both scales), and the refusals of a negative or
  non-finite scale and of mismatched shapes;
- the format read from config.json and from an older export's hf_quant_config.json, and refused
  by name for another group size or in a family that does not ship it;
- greedy ids and logits at (1,1), EP2 and TP2 against transformers on the oracle, for Qwen3-MoE,
  DeepSeek-V3 and Nemotron-H (ungated experts);
- moeshard's own ``--compare`` model of an NVFP4 checkpoint is transformers on those very values;
- the experts read as any scheme: ``fp8_token`` quantizes the dequantized weights;
- planted faults: the nibbles swapped, and the global scale left out; a missing scale named;
- training's save of a model read from it is a full-precision checkpoint with the same logits;
- fused NVFP4 experts refused by name.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from generate_worlds import GenerateWorlds
from quantized_checkpoints import (
    LAYOUTS,
    assert_compare_model_is_the_oracle,
    assert_saves_as_full_precision,
    judge,
    oracle_generations,
    save_beside,
    tiny_pairs,
)
from safetensors.torch import load_file, save_file

from moeshard.checkpoint import load_moe_block, read_hf_config
from moeshard.checkpoint.hf_config import parse_hf_config
from moeshard.checkpoint.mxfp4 import E2M1
from moeshard.checkpoint.nvfp4_modelopt import dequantize_nvfp4
from moeshard.config import QuantConfig
from moeshard.jobs.generate import GenerateSpec, compare_generations, generate_rank, plan_generate
from moeshard.parallel.config import ParallelConfig

PROMPTS = ((3, 17, 42, 5, 9), (1, 2, 3), (7, 8, 9, 10), (11, 12))
NEW_TOKENS = 3
SPAWN_TIMEOUT_S = 300
LINEAR = re.compile(r"\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj|in_proj|out_proj|"
                    r"fc1_latent_proj|fc2_latent_proj|kv_a_proj_with_mqa|kv_b_proj|q_a_proj|q_b_proj)\.weight$")
MAGNITUDES = torch.tensor(E2M1[:8])


@dataclasses.dataclass(frozen=True)
class Case:
    """family: the tiny model's; legacy: the quantization stated in hf_quant_config.json only;
    skip_attention: attention left in full precision; sizes: hidden, moe intermediate, experts."""

    family: str
    legacy: bool = False
    skip_attention: bool = False
    sizes: tuple[int, int, int] = (64, 48, 4)


CASES = {
    "qwen3_moe": Case("qwen3_moe"),
    "deepseek_v3": Case("deepseek_v3"),
    "nemotron_h-legacy": Case("nemotron_h", legacy=True, skip_attention=True, sizes=(256, 96, 8)),
}
QUANTIZATION = {"quant_algo": "NVFP4", "group_size": 16, "kv_cache_quant_algo": None,
                "exclude_modules": ["lm_head", "*.gate"]}


def quantize_nvfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [R, C] -> (packed uint8 [R, C / 2], e4m3 scales [R, C / 16], fp32 global scale [], and the
    e2m1 values [R, C] before packing)."""
    w = w.float()
    g = (w.abs().amax() / (6 * 448)).clamp(min=2.0**-100)
    groups = w.unflatten(-1, (-1, 16))
    s = (groups.abs().amax(-1) / (6 * g)).to(torch.float8_e4m3fn)
    x = groups / (s.float().unsqueeze(-1) * g)
    x = torch.where(torch.isfinite(x), x, torch.zeros_like(x)).clamp(-6, 6)
    index = (x.abs().unsqueeze(-1) - MAGNITUDES).abs().argmin(-1)
    values = (MAGNITUDES[index] * torch.where(x < 0, -1.0, 1.0)).flatten(-2)
    codes = (index | torch.where(x < 0, 8, 0)).flatten(-2).to(torch.uint8)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed, s, g, values


def _write(src: Path, dst: Path, oracle_dir: Path, case: Case) -> None:
    tensors = load_file(src / "model.safetensors")
    chosen = [n for n in tensors if LINEAR.search(n) and not (case.skip_attention and ".self_attn." in n)
              and not (case.skip_attention and ".mixer." in n and "proj" in n and "experts" not in n)]
    assert any(".experts." in n for n in chosen), sorted(tensors)[:20]
    nv, oracle = dict(tensors), dict(tensors)
    for name in chosen:
        packed, s, g, values = quantize_nvfp4(tensors[name])
        nv[name], nv[name + "_scale"], nv[name + "_scale_2"] = packed, s, g
        nv[name[: -len("weight")] + "input_scale"] = torch.tensor(0.02)  # static activation scale: not used
        oracle[name] = ((values.unflatten(-1, (-1, 16)) * s.float().unsqueeze(-1)).flatten(-2) * g).to(
            tensors[name].dtype)
    config = json.loads((src / "config.json").read_text())
    save_beside(src, oracle_dir, oracle, config)
    save_beside(src, dst, nv, config if case.legacy else {**config, "quantization_config": {"quant_method": "modelopt",
                                                                                              **QUANTIZATION}})
    if case.legacy:
        (dst / "hf_quant_config.json").write_text(json.dumps(
            {"producer": {"name": "modelopt", "version": "0.29.0"}, "quantization": QUANTIZATION}))


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """case -> (its NVFP4 checkpoint, its oracle)."""
    return tiny_pairs(tmp_path_factory.mktemp("nvfp4"), CASES, _write, seed=7)


def _plan(model_dir: Path, layout: ParallelConfig | None = None, quant: str = "none"):
    return plan_generate(GenerateSpec(str(model_dir), PROMPTS, NEW_TOKENS, layout or ParallelConfig(), dtype="float32",
                                      compare=True, quant=quant))


@pytest.fixture(scope="module")
def oracles(ckpts):
    """(case, DP size) -> transformers' own generation on the oracle."""
    get = oracle_generations(_plan)
    return lambda cid, dp=1: get(ckpts[cid][1], dp)


# -- hand-computed -----------------------------------------------------------------------------
def test_dequantization_by_hand():
    # codes 2 (1.0) and 0xB (-1.5) in the first byte: the low nibble is the even column
    packed = torch.tensor([[0xB2] + [0x00] * 7 + [0x7F] + [0x00] * 7], dtype=torch.uint8)  # 32 values
    scale = torch.tensor([[2.0, 0.5]]).to(torch.float8_e4m3fn)
    got = dequantize_nvfp4(packed, scale, torch.tensor([3.0]), torch.float32)
    want = torch.zeros(1, 32)
    want[0, 0], want[0, 1] = 1.0 * 2 * 3, -1.5 * 2 * 3
    want[0, 16], want[0, 17] = -6.0 * 0.5 * 3, 6.0 * 0.5 * 3  # 0x7F: low nibble 0xF (-6), high 0x7 (6)
    assert torch.equal(got, want)


@pytest.mark.parametrize("packed, scale, global_scale, message", [
    (torch.zeros(2, 8, dtype=torch.uint8), torch.full((2, 1), -1.0), torch.tensor(1.0), r"must be finite and >= 0"),
    (torch.zeros(2, 8, dtype=torch.uint8), torch.ones(2, 1), torch.tensor(float("inf")), r"must be finite and >= 0"),
    (torch.zeros(2, 8, dtype=torch.uint8), torch.ones(2, 2), torch.tensor(1.0), r"got \[2, 8\] and \[2, 2\]"),
    (torch.zeros(2, 8, dtype=torch.uint8), torch.ones(2, 1), torch.ones(2), r"global scale must hold one value"),
])
def test_bad_scales_or_shapes_are_refused(packed, scale, global_scale, message):
    with pytest.raises(ValueError, match=message):
        dequantize_nvfp4(packed, scale.to(torch.float8_e4m3fn), global_scale, torch.float32, "w")


# -- the format --------------------------------------------------------------------------------
def test_the_format_is_read_from_config_json_and_hf_quant_config(ckpts):
    for cid in CASES:
        info = read_hf_config(ckpts[cid][0])
        assert info.checkpoint_format == "modelopt_nvfp4" and info.format.dequantized, cid


def test_another_group_size_or_family_is_refused_naming_it(ckpts):
    raw = json.loads((ckpts["qwen3_moe"][0] / "config.json").read_text())
    raw["quantization_config"]["group_size"] = 32
    with pytest.raises(ValueError, match=r"quant_algo 'NVFP4' has group_size=32; NVFP4 scales cover 16 values"):
        parse_hf_config(raw)
    raw["quantization_config"]["group_size"] = 16
    with pytest.raises(ValueError, match=r"quant_method='modelopt' is not supported for model_type 'minimax'"):
        parse_hf_config(dict(raw, model_type="minimax"))


# -- whole models against transformers ----------------------------------------------------------
@pytest.mark.parametrize("cid", list(CASES))
def test_one_rank_equals_transformers_on_the_dequantized_weights(ckpts, oracles, cid):
    plan = _plan(ckpts[cid][0])
    judge(plan, [generate_rank(plan, None)], oracles(cid), cid)
    assert_compare_model_is_the_oracle(plan, oracles(cid))


FAST = {("dp2-tp1-ep", "deepseek_v3"), ("dp1-tp2-noep", "qwen3_moe"), ("dp1-tp2-noep", "nemotron_h-legacy")}


@pytest.fixture(scope="module")
def world(ckpts):
    def cases(slow: bool):
        chosen = [(layout, cid) for layout in LAYOUTS for cid in CASES if ((layout, cid) in FAST) != slow]
        return chosen, [_plan(ckpts[cid][0], LAYOUTS[layout]) for layout, cid in chosen]

    return GenerateWorlds(cases, SPAWN_TIMEOUT_S)


@pytest.mark.parametrize("layout, cid", [
    pytest.param(layout, cid, marks=() if (layout, cid) in FAST else (pytest.mark.slow,))
    for layout in LAYOUTS for cid in CASES])
def test_layout_equals_transformers_on_the_dequantized_weights(world, oracles, layout, cid):
    plan, results = world((layout, cid) not in FAST)[(layout, cid)]
    judge(plan, results, oracles(cid, LAYOUTS[layout].dp), f"{layout} {cid}")


def _moe_layer(model_dir: Path) -> int:
    info = read_hf_config(model_dir)
    return next(layer for layer in range(info.num_layers) if layer not in info.dense_layers)


def test_the_experts_load_as_any_scheme(ckpts):
    """fp8_token from an NVFP4 checkpoint: the dequantized experts quantized per row, as from a
    full-precision checkpoint of those values."""
    nv, oracle = ckpts["qwen3_moe"]
    layer = _moe_layer(nv)
    got = load_moe_block(nv, layer, quant=QuantConfig("fp8_token"))
    want = load_moe_block(oracle, layer, quant=QuantConfig("fp8_token"))
    for a, b in ((got.local_experts.gate_up, want.local_experts.gate_up),
                 (got.local_experts.down, want.local_experts.down)):
        assert torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8)) and torch.equal(a.scale, b.scale)


@pytest.mark.parametrize("fault", ["nibbles", "global"])
def test_planted_faults_are_seen(ckpts, oracles, monkeypatch, fault):
    """The nibbles read high first, or the global scale left out: the logits move."""
    from moeshard.checkpoint import nvfp4_modelopt

    real = nvfp4_modelopt.dequantize_nvfp4
    if fault == "nibbles":
        swap = lambda p: (p >> 4) | ((p & 0x0F) << 4)  # noqa: E731
        monkeypatch.setattr(nvfp4_modelopt, "dequantize_nvfp4", lambda p, s, g, d, n="": real(swap(p), s, g, d, n))
    else:
        monkeypatch.setattr(nvfp4_modelopt, "dequantize_nvfp4", lambda p, s, g, d, n="": real(p, s, g * 0 + 1, d, n))
    plan = _plan(ckpts["qwen3_moe"][0])
    c = compare_generations(plan, [generate_rank(plan, None)], oracles("qwen3_moe"))
    seen = [d for d in c.step_max_abs if d is not None]
    assert not all(c.same_ids) or max(seen) > 1e-3, c


def test_a_missing_global_scale_is_refused_naming_it(ckpts, tmp_path):
    nv = ckpts["qwen3_moe"][0]
    layer = _moe_layer(nv)
    name = f"model.layers.{layer}.mlp.experts.1.down_proj.weight_scale_2"
    bad = tmp_path / "bad"
    shutil.copytree(nv, bad)
    tensors = load_file(bad / "model.safetensors")
    del tensors[name]
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=re.escape(name) + r"' is missing"):
        load_moe_block(bad, layer)


@pytest.mark.parametrize("cid", ["qwen3_moe", "nemotron_h-legacy"])
def test_a_model_read_dequantized_saves_as_full_precision(ckpts, tmp_path, cid):
    """Training's save of a model read from an NVFP4 checkpoint: a model-dtype checkpoint without the
    source's quantization (its config nor an hf_quant_config.json), which reads back to the same
    logits."""
    assert_saves_as_full_precision(ckpts[cid][0], tmp_path / "saved", PROMPTS[0])


def test_fused_nvfp4_experts_are_refused_naming_them(ckpts, tmp_path):
    """ModelOpt quantizes each expert's linear layers; NVFP4 experts stored fused are refused by
    name, before any data is read."""
    nv = ckpts["qwen3_moe"][0]
    layer = _moe_layer(nv)
    tensors = load_file(nv / "model.safetensors")
    prefix = f"model.layers.{layer}.mlp.experts."
    E = CASES["qwen3_moe"].sizes[2]
    fused = {prefix + "gate_up_proj": torch.stack([torch.cat([tensors[f"{prefix}{e}.gate_proj.weight"],
                                                              tensors[f"{prefix}{e}.up_proj.weight"]])
                                                   for e in range(E)]),
             prefix + "down_proj": torch.stack([tensors[f"{prefix}{e}.down_proj.weight"] for e in range(E)])}
    kept = {n: t for n, t in tensors.items() if not n.startswith(prefix)}
    bad = tmp_path / "fused"
    shutil.copytree(nv, bad)
    save_file({**kept, **fused}, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=re.escape(prefix + "gate_up_proj") + r": an NVIDIA ModelOpt NVFP4 checkpoint .* is "
                                         r"read with per-expert tensors"):
        load_moe_block(bad, layer)
