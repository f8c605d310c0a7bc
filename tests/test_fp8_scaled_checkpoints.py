"""FP8 checkpoints whose e4m3 weights carry one scale per tensor or per output row: NVIDIA
ModelOpt's export (``quant_method`` ``modelopt``, ``quant_algo`` FP8 or FP8_PER_CHANNEL_PER_TOKEN,
or only an ``hf_quant_config.json`` in older exports) and compressed-tensors' ``float-quantized``
(Red Hat's FP8-dynamic releases, Meta's Llama 4 FP8).

Each checkpoint here is written from a tiny random transformers model by this file's own quantizer
(scale = amax / 448, q = e4m3(w / scale)), beside an oracle: a full-precision checkpoint of this
file's own q.float() * scale, which transformers loads itself. So what moeshard reads is checked
against values computed here, and the whole model against transformers running them:

* hand-computed dequantization of the scale shapes these formats use ([], [1], [R], [R, 1]);
* the experts read as stored (fp8_token: the file's bytes and each row's scale; fp8_tensor where one
  scale covers an expert weight), the slices each rank of a TP or EP layout reads, and the layer on
  them against the fp64 reference on the dequantized weights;
* whole models (router, attention, Mamba projections, shared experts and experts) at one rank and
  under EP2 and TP2 against transformers on the oracle; moeshard's own ``--compare`` model of such a
  checkpoint is that oracle's, bit for bit;
* each malformed config or tensor refused, naming the field or tensor.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch
from generate_worlds import GenerateWorlds
from quantized_checkpoints import assert_saves_as_full_precision, oracle_generations, save_beside, tiny_pairs
from safetensors.torch import load_file, save_file

from moeshard.checkpoint import load_moe_block, read_hf_config
from moeshard.checkpoint.dense import read_dense
from moeshard.checkpoint.hf_config import parse_hf_config
from moeshard.checkpoint.loader import build_layer
from moeshard.checkpoint.reader import SafetensorsCheckpoint
from moeshard.config import QuantConfig
from moeshard.jobs.generate import (
    GenerateSpec,
    compare_generations,
    generate_rank,
    plan_generate,
    reference_generate,
)
from moeshard.parallel.config import ParallelConfig
from moeshard.quant import QuantizedWeight
from moeshard.reference import DequantizedExperts, reference_forward
from moeshard.tolerances import compare

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

E4M3_MAX = 448.0
PROMPTS = ((3, 17, 42, 5, 9), (1, 2, 3), (7, 8, 9, 10), (11, 12))
NEW_TOKENS = 3
SPAWN_TIMEOUT_S = 300
# The Linear weights quantized (routers, norms, embeddings, convolutions and lm_head stay float).
LINEAR = re.compile(r"\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj|w1|w2|w3|in_proj|out_proj|"
                    r"fc1_latent_proj|fc2_latent_proj)\.weight$")


@dataclasses.dataclass(frozen=True)
class Case:
    """family: the tiny model's; fmt: ``modelopt`` / ``compressed`` (quantization_config in
    config.json) or ``modelopt_legacy`` (hf_quant_config.json only); per_row: a scale per output row,
    else per tensor; shared_gate_up: one scale for an expert's gate and up (fp8_tensor reads it as
    stored); skip_attention: attention left in full precision (NVIDIA's Nemotron recipe)."""

    family: str
    fmt: str
    per_row: bool
    shared_gate_up: bool = False
    skip_attention: bool = False
    sizes: tuple[int, int, int] = (64, 32, 4)  # hidden, moe intermediate, experts


CASES = {
    "qwen3_moe-compressed-per_row": Case("qwen3_moe", "compressed", True),
    "qwen3_moe-modelopt-per_tensor": Case("qwen3_moe", "modelopt", False, shared_gate_up=True),
    "mixtral-compressed-per_tensor": Case("mixtral", "compressed", False),
    "qwen2_moe-modelopt-per_row": Case("qwen2_moe", "modelopt", True),
    "nemotron_h-modelopt_legacy-per_tensor": Case("nemotron_h", "modelopt_legacy", False, skip_attention=True,
                                                  sizes=(256, 128, 8)),
    "qwen3_next-compressed-per_row": Case("qwen3_next", "compressed", True),
    "glm4_moe-compressed-per_row": Case("glm4_moe", "compressed", True),
}


def _quantization_config(case: Case) -> dict:
    if case.fmt == "compressed":
        weights = {"num_bits": 8, "type": "float", "strategy": "channel" if case.per_row else "tensor",
                   "symmetric": True, "dynamic": False}
        acts = {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True, "dynamic": True}
        return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts}},
                "ignore": ["lm_head", "re:.*mlp.gate$"]}
    return {"quant_method": "modelopt", "quant_algo": "FP8_PER_CHANNEL_PER_TOKEN" if case.per_row else "FP8",
            "kv_cache_quant_algo": None, "exclude_modules": ["lm_head", "*.gate"]}


def _scale_key(name: str, case: Case) -> str:
    return re.sub(r"\.(gate_proj|up_proj)\.", ".gate_up.", name) if case.shared_gate_up else name


def _write(src: Path, fp8_dir: Path, oracle_dir: Path, case: Case) -> None:
    """The FP8 checkpoint of ``case`` from the full-precision ``src``, and the oracle beside it."""
    tensors = load_file(src / "model.safetensors")
    chosen = [n for n in tensors if LINEAR.search(n) and not (case.skip_attention and ".self_attn." in n)]
    amax: dict[str, torch.Tensor] = {}
    for name in chosen:
        w = tensors[name].float()
        a = w.abs().amax(dim=1, keepdim=True) if case.per_row else w.abs().amax()
        key = _scale_key(name, case)
        amax[key] = torch.maximum(amax[key], a) if key in amax else a
    fp8, oracle = dict(tensors), dict(tensors)
    for name in chosen:
        scale = amax[_scale_key(name, case)] / E4M3_MAX
        q = (tensors[name].float() / scale).to(torch.float8_e4m3fn)
        stem = name[: -len("weight")]
        fp8[name] = q
        # modelopt keeps a per-tensor scale as a 0-dim tensor, compressed-tensors as [1].
        fp8[stem + "weight_scale"] = scale if case.per_row else scale.reshape(() if "modelopt" in case.fmt else (1,))
        fp8[stem + "input_scale"] = torch.tensor(0.02)  # static activation scale: not used by moeshard
        oracle[name] = (q.float() * scale).to(tensors[name].dtype)
    config = json.loads((src / "config.json").read_text())
    save_beside(src, oracle_dir, oracle, config)
    q = _quantization_config(case)
    legacy = case.fmt == "modelopt_legacy"
    save_beside(src, fp8_dir, fp8, config if legacy else {**config, "quantization_config": q})
    if legacy:
        (fp8_dir / "hf_quant_config.json").write_text(json.dumps(
            {"producer": {"name": "modelopt", "version": "0.29.0"},
             "quantization": {k: v for k, v in q.items() if k != "quant_method"}}))


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """case -> (its FP8 checkpoint, its oracle)."""
    return tiny_pairs(tmp_path_factory.mktemp("fp8-scaled"), CASES, _write, seed=3)


def _moe_layer(model_dir: Path) -> int:
    info = read_hf_config(model_dir)
    return next(layer for layer in range(info.num_layers) if layer not in info.dense_layers)


# -- hand-computed -----------------------------------------------------------------------------
@pytest.mark.parametrize("scale, expected", [
    (torch.tensor(0.5), [[0.5, 1.0, -0.25], [2.0, 0.125, 4.0]]),          # ModelOpt FP8: one value, 0-dim
    (torch.tensor([0.5]), [[0.5, 1.0, -0.25], [2.0, 0.125, 4.0]]),        # compressed-tensors "tensor": [1]
    (torch.tensor([[2.0], [0.25]]), [[2.0, 4.0, -1.0], [1.0, 0.0625, 2.0]]),  # "channel": [R, 1]
    (torch.tensor([2.0, 0.25]), [[2.0, 4.0, -1.0], [1.0, 0.0625, 2.0]]),      # per row, flat: [R]
])
def test_row_scales_dequantize_as_q_times_scale(tmp_path, scale, expected):
    q = torch.tensor([[1.0, 2.0, -0.5], [4.0, 0.25, 8.0]]).to(torch.float8_e4m3fn)  # exact in e4m3
    save_file({"a.weight": q, "a.weight_scale": scale}, str(tmp_path / "model.safetensors"))
    got = read_dense(SafetensorsCheckpoint(tmp_path), "a.weight", (2, 3), torch.float32, "row")
    assert torch.equal(got, torch.tensor(expected))


@pytest.mark.parametrize("scale, message", [
    (torch.tensor([0.5, 0.5, 0.5]), r"'a\.weight_scale' .* has shape \[3\] .* weight of 2 rows"),
    (torch.tensor([[0.5, 0.5]]), r"'a\.weight_scale' .* has shape \[1, 2\]"),
    (torch.tensor([0.5, 0.0]), r"'a\.weight_scale' .*: a scale is <= 0"),
    (torch.tensor(-1.0), r"'a\.weight_scale' .*: a scale is <= 0"),
    (torch.tensor(float("inf")), r"a\.weight_scale"),
    (torch.tensor([1], dtype=torch.int32), r"'a\.weight_scale' .* has shape \[1\] and dtype torch\.int32"),
])
def test_bad_row_scales_are_refused_naming_the_tensor(tmp_path, scale, message):
    q = torch.ones(2, 3).to(torch.float8_e4m3fn)
    save_file({"a.weight": q, "a.weight_scale": scale}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=message):
        read_dense(SafetensorsCheckpoint(tmp_path), "a.weight", (2, 3), torch.float32, "row")


# -- the experts as stored -----------------------------------------------------------------------
def _stored_expert(fp8_dir: Path, names, e: int, case: Case) -> tuple[torch.Tensor, ...]:
    """Expert e from the file: (gate_up codes [P*I, H], their row scales [P*I], down codes, row scales)."""
    t = load_file(fp8_dir / "model.safetensors")
    projections = ("up",) if case.family == "nemotron_h" else ("gate", "up")

    def rows(proj: str) -> tuple[torch.Tensor, torch.Tensor]:
        name = names.expert(e, proj)
        q = t[name]
        return q, t[name[: -len("weight")] + "weight_scale"].float().reshape(-1).expand(q.shape[0])

    parts = [rows(p) for p in projections]
    down, down_scale = rows("down")
    return torch.cat([q for q, _ in parts]), torch.cat([s for _, s in parts]), down, down_scale


@pytest.mark.parametrize("cid", CASES)
def test_experts_load_as_stored_bytes_and_scales(ckpts, cid):
    case, (fp8_dir, _) = CASES[cid], ckpts[cid]
    layer = _moe_layer(fp8_dir)
    block = load_moe_block(fp8_dir, layer)  # the checkpoint's own scheme: fp8_token
    assert block.quant.scheme == "fp8_token"
    gu, dn = block.local_experts.gate_up, block.local_experts.down
    assert isinstance(gu, QuantizedWeight) and isinstance(dn, QuantizedWeight)
    for e in range(block.cfg.num_experts):
        q, s, dq, ds = _stored_expert(fp8_dir, block.names, e, case)
        assert torch.equal(gu.data[e].view(torch.uint8), q.view(torch.uint8))
        assert torch.equal(gu.scale[e], s) and torch.equal(dn.scale[e], ds)
        assert torch.equal(dn.data[e].view(torch.uint8), dq.view(torch.uint8))
    # Dequantized ("none"): w = q * scale in fp32, exactly the oracle's values.
    plain = load_moe_block(fp8_dir, layer, quant="none", dtype="float32").local_experts
    for e in range(block.cfg.num_experts):
        q, s, dq, ds = _stored_expert(fp8_dir, block.names, e, case)
        assert torch.equal(plain.gate_up[e], q.float() * s[:, None])
        assert torch.equal(plain.down[e], dq.float() * ds[:, None])


def test_a_blocks_scales_are_read_in_one_pass(ckpts, monkeypatch):
    """A large per-row checkpoint holds three scale tensors per expert per layer: they are read
    with one opening of each file for the whole block, not one per scale (the experts' bytes are
    read expert by expert, to bound the memory a rank holds)."""
    from moeshard.checkpoint.reader import SafetensorsCheckpoint

    fp8_dir, _ = ckpts["qwen3_moe-compressed-per_row"]
    layer = _moe_layer(fp8_dir)
    scale_reads: list[int] = []
    many = SafetensorsCheckpoint.read_many

    def counted(self, requests, dtype=None):
        if all(name.endswith("weight_scale") for name, _ in requests):
            scale_reads.append(len(requests))
        return many(self, requests, dtype)

    monkeypatch.setattr(SafetensorsCheckpoint, "read_many", counted)
    block = load_moe_block(fp8_dir, layer)
    experts = block.cfg.num_experts
    assert 3 * experts in scale_reads, scale_reads  # gate, up and down of every expert at once
    assert scale_reads.count(1) <= 3, scale_reads  # none one by one, but the shared expert's


@pytest.mark.parametrize("cid", CASES)
def test_each_rank_reads_its_slice_of_the_stored_experts(ckpts, cid):
    """TP2: rank r's gate/up rows and down columns of I, with the stored scales (down's span all of
    I: every rank keeps them whole); EP2: rank r's experts, whole."""
    fp8_dir = ckpts[cid][0]
    layer = _moe_layer(fp8_dir)
    whole = load_moe_block(fp8_dir, layer).local_experts
    P = 1 if CASES[cid].family == "nemotron_h" else 2
    E, _, I = whole.down.shape
    for rank in range(2):
        tp = load_moe_block(fp8_dir, layer, parallel=ParallelConfig(1, 2, False), rank=rank).local_experts
        w = I // 2
        keep = torch.cat([torch.arange(p * I + rank * w, p * I + (rank + 1) * w) for p in range(P)])
        assert torch.equal(tp.gate_up.data.view(torch.uint8), whole.gate_up.data[:, keep].view(torch.uint8))
        assert torch.equal(tp.gate_up.scale, whole.gate_up.scale[:, keep])
        assert torch.equal(tp.down.data.view(torch.uint8),
                           whole.down.data[:, :, rank * w:(rank + 1) * w].view(torch.uint8))
        assert torch.equal(tp.down.scale, whole.down.scale)
        ep = load_moe_block(fp8_dir, layer, parallel=ParallelConfig(2, 1, True), rank=rank).local_experts
        mine = slice(rank * E // 2, (rank + 1) * E // 2)
        assert torch.equal(ep.gate_up.data.view(torch.uint8), whole.gate_up.data[mine].view(torch.uint8))
        assert torch.equal(ep.down.scale, whole.down.scale[mine])


def test_fp8_tensor_takes_one_stored_scale_per_expert_weight(ckpts):
    """fp8_tensor reads the stored scale where one covers each expert weight (Nemotron-H's ungated
    up and down; gate and up scaled together) and refuses, naming the tensors, where gate and up
    have their own."""
    for cid in ("nemotron_h-modelopt_legacy-per_tensor", "qwen3_moe-modelopt-per_tensor"):
        fp8_dir = ckpts[cid][0]
        layer = _moe_layer(fp8_dir)
        tensor = load_moe_block(fp8_dir, layer, quant="fp8_tensor").local_experts
        token = load_moe_block(fp8_dir, layer, quant="fp8_token").local_experts
        assert tensor.gate_up.scale.shape == (token.gate_up.scale.shape[0],)
        assert torch.equal(tensor.gate_up.scale, token.gate_up.scale[:, 0])
        assert torch.equal(tensor.down.scale, token.down.scale[:, 0])
        assert torch.equal(tensor.gate_up.data.view(torch.uint8), token.gate_up.data.view(torch.uint8))
    fp8_dir = ckpts["mixtral-compressed-per_tensor"][0]
    with pytest.raises(ValueError, match=r"quant 'fp8_tensor' takes one scale for expert 0's gate_up, but its stored "
                                         r"scales \[.*experts\.0\.w1\.weight_scale.*w3\.weight_scale'\] hold 2 values"):
        load_moe_block(fp8_dir, _moe_layer(fp8_dir), quant="fp8_tensor")
    with pytest.raises(ValueError, match=r"quant 'fp8_block' was asked for, but .* loads only as quant 'fp8_token' or "
                                         r"'fp8_tensor' \(as stored\) or 'none'"):
        load_moe_block(fp8_dir, _moe_layer(fp8_dir), quant="fp8_block")


@pytest.mark.parametrize("cid, scheme", [(c, s) for c in CASES if CASES[c].family != "nemotron_h"
                                         for s in ("fp8_token", "fp8_tensor") if s == "fp8_token"
                                         or CASES[c].shared_gate_up])
def test_layer_on_the_stored_experts_matches_the_reference(ckpts, cid, scheme):
    """The layer (router, stored experts, shared experts) against the fp64 reference on the stored
    experts' values, quantizing activations as the scheme says, within its tolerance. The reference
    takes those values as they are (``experts``): quantizing them again per row, as it does full-
    precision weights, would move per-tensor ones (a row's amax need not reach 448)."""
    fp8_dir = ckpts[cid][0]
    layer = _moe_layer(fp8_dir)
    block = load_moe_block(fp8_dir, layer, quant=scheme, dtype="float32")
    plain = load_moe_block(fp8_dir, layer, quant="none", dtype="float32").local_experts
    weights = dataclasses.replace(block.weights, gate_up=plain.gate_up, down=plain.down)
    x = torch.randn(24, block.cfg.hidden_size, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        out = build_layer(block)(x)
    stored = DequantizedExperts(plain.gate_up.double(), plain.down.double(), scheme)
    expected = reference_forward(x, weights, block.cfg, QuantConfig(scheme), experts=stored)
    err, atol, rtol, ok = compare(out, expected, torch.float32, scheme)
    assert ok, f"{cid} {scheme}: max |out - expected| = {err:.3g} > {atol} + {rtol}*|expected|"


# -- whole models --------------------------------------------------------------------------------
def _plan(model_dir: Path, layout: ParallelConfig | None = None, quant: str | None = "none"):
    return plan_generate(GenerateSpec(str(model_dir), PROMPTS, NEW_TOKENS, layout or ParallelConfig(), quant=quant,
                                      dtype="float32", compare=True))


@pytest.fixture(scope="module")
def oracle(ckpts):
    """case -> transformers' own generation on the oracle, per DP size."""
    get = oracle_generations(_plan)
    return lambda cid, dp=1: get(ckpts[cid][1], dp)


@pytest.mark.parametrize("cid", CASES)
def test_one_rank_equals_transformers_on_the_dequantized_weights(ckpts, oracle, cid):
    plan = _plan(ckpts[cid][0])
    assert plan.model_type == CASES[cid].family
    c = compare_generations(plan, [generate_rank(plan, None)], oracle(cid))
    assert all(c.same_ids), f"{cid}: ids differ at steps {c.first_difference}"
    assert c.within_tolerance, f"{cid}: logits off by {c.step_max_abs}"
    # moeshard's own --compare model of the FP8 checkpoint is transformers on those very values.
    mine = reference_generate(plan)
    for (ids, logits), (oracle_ids, oracle_logits) in zip(mine, oracle(cid), strict=True):
        assert ids == oracle_ids and all(torch.equal(a, b) for a, b in zip(logits, oracle_logits, strict=True))


LAYOUTS = (ParallelConfig(2, 1, True), ParallelConfig(1, 2, False))
# make test runs the layouts of one checkpoint per storage (per row and compressed-tensors; per
# tensor, legacy ModelOpt and ungated; moeshard's own shared expert); make test-slow the others.
FAST_LAYOUTS = ("qwen3_moe-compressed-per_row", "nemotron_h-modelopt_legacy-per_tensor", "qwen2_moe-modelopt-per_row")


@pytest.fixture(scope="module")
def world(ckpts):
    def cases(slow: bool):
        chosen = [(layout, cid) for layout in LAYOUTS for cid in CASES if (cid in FAST_LAYOUTS) != slow]
        return [(layout.name, cid) for layout, cid in chosen], [_plan(ckpts[cid][0], layout) for layout, cid in chosen]

    worlds = GenerateWorlds(cases, SPAWN_TIMEOUT_S)
    return lambda slow: worlds(slow)


@pytest.mark.parametrize("layout", [layout.name for layout in LAYOUTS])
@pytest.mark.parametrize("cid", [pytest.param(c, marks=() if c in FAST_LAYOUTS else (pytest.mark.slow,)) for c in CASES])
def test_layout_equals_transformers_on_the_dequantized_weights(world, oracle, layout, cid):
    plan, results = world(cid not in FAST_LAYOUTS)[(layout, cid)]
    for r in results:
        assert not isinstance(r, dict), f"rank raised: {r}"
    c = compare_generations(plan, results, oracle(cid, plan.parallel.dp))
    assert all(c.same_ids), f"{layout} {cid}: ids differ at steps {c.first_difference}"
    assert c.within_tolerance, f"{layout} {cid}: logits off by {c.step_max_abs}"


# -- refusals ------------------------------------------------------------------------------------
def _raw(ckpts, cid: str) -> dict:
    return json.loads((ckpts[cid][0] / "config.json").read_text())


@pytest.mark.parametrize("change, message", [
    ({"quant_algo": "W4A8_AWQ"}, r"quant_method 'modelopt' has quant_algo 'W4A8_AWQ'; moeshard reads \['FP8', "),
    ({"quant_algo": "MIXED_PRECISION", "quantized_layers": {"model.layers.0.mlp": {"quant_algo": "NVFP4"}}},
     r"quantized_layers\['model.layers.0.mlp'\] has quant_algo 'NVFP4' \(1 such layers\)"),
    ({"quant_algo": "MIXED_PRECISION"}, r"MIXED_PRECISION' needs a non-empty quantized_layers object, got None"),
])
def test_modelopt_configs_moeshard_does_not_read_are_refused(ckpts, change, message):
    raw = _raw(ckpts, "qwen3_moe-modelopt-per_tensor")
    raw["quantization_config"].update(change)
    with pytest.raises(ValueError, match=message):
        parse_hf_config(raw)
    changed = dict(raw["quantization_config"], quant_algo="MIXED_PRECISION",
                   quantized_layers={"model.layers.0.mlp": {"quant_algo": "FP8"}})
    assert parse_hf_config(dict(raw, quantization_config=changed)).checkpoint_format == "modelopt_fp8"


@pytest.mark.parametrize("path, value, message", [
    (("config_groups", "group_0", "weights", "type"), "int", r"weights\.type='int'; moeshard reads type='float'"),
    (("config_groups", "group_0", "weights", "num_bits"), 4, r"weights\.num_bits=4"),
    (("config_groups", "group_0", "weights", "strategy"), "group", r"weights\.strategy='group'; moeshard reads "
                                                                   r"\['tensor', 'channel'\]"),
    (("config_groups", "group_0", "weights", "group_size"), 128, r"group_size=128"),
    (("config_groups", "group_0", "input_activations", "strategy"), "group", r"input_activations\.strategy='group'"),
    (("format",), "pack-quantized", r"has format 'pack-quantized'; moeshard reads 'float-quantized'"),
    (("sparsity_config",), {"format": "sparse-24"}, r"sparsity_config; sparse compressed-tensors"),
    (("config_groups",), {}, r"needs a non-empty config_groups object"),
])
def test_compressed_tensors_configs_moeshard_does_not_read_are_refused(ckpts, path, value, message):
    raw = _raw(ckpts, "qwen3_moe-compressed-per_row")
    target = raw["quantization_config"]
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    with pytest.raises(ValueError, match=message):
        parse_hf_config(raw)


def test_a_family_without_the_format_refuses_it(ckpts):
    raw = dict(_raw(ckpts, "mixtral-compressed-per_tensor"), model_type="minimax")
    with pytest.raises(ValueError, match=r"quant_method='compressed-tensors' is not supported for model_type "
                                         r"'minimax'; its formats: bf16"):
        parse_hf_config(raw)


def _rewrite(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("edit, message", [
    (lambda t, n: t.pop(n + "_scale"), r"tensor '.*experts\.1\.gate_proj\.weight_scale' is missing"),
    (lambda t, n: t.update({n + "_scale": torch.ones(3, 1)}), r"experts\.1\.gate_proj\.weight_scale' .* has shape "
                                                              r"\[3, 1\]"),
    (lambda t, n: t.update({n: t[n].float()}), r"experts\.1\.gate_proj\.weight' .* has dtype torch\.float32, expected "
                                               r"one of \['torch\.float8_e4m3fn'\]"),
])
def test_malformed_expert_tensors_are_refused_naming_them(ckpts, tmp_path, edit, message):
    fp8_dir = ckpts["qwen3_moe-compressed-per_row"][0]
    layer = _moe_layer(fp8_dir)
    name = f"model.layers.{layer}.mlp.experts.1.gate_proj.weight"
    bad = _rewrite(fp8_dir, tmp_path / "bad", lambda t: edit(t, name))
    with pytest.raises(ValueError, match=message):
        load_moe_block(bad, layer)


def test_a_zero_expert_scale_is_refused_when_read(ckpts, tmp_path):
    fp8_dir = ckpts["qwen3_moe-modelopt-per_tensor"][0]
    layer = _moe_layer(fp8_dir)
    name = f"model.layers.{layer}.mlp.experts.2.down_proj.weight_scale"
    bad = _rewrite(fp8_dir, tmp_path / "bad", lambda t: t.update({name: torch.tensor(0.0)}))
    with pytest.raises(ValueError, match=re.escape(name) + r"' .*: a scale is <= 0"):
        load_moe_block(bad, layer)


def test_a_legacy_hf_quant_config_without_its_quantization_object_is_refused(ckpts, tmp_path):
    bad = tmp_path / "legacy"
    shutil.copytree(ckpts["nemotron_h-modelopt_legacy-per_tensor"][0], bad)
    (bad / "hf_quant_config.json").write_text(json.dumps({"producer": {"name": "modelopt"}}))
    with pytest.raises(ValueError, match=r"hf_quant_config\.json: expected an object with a 'quantization' object"):
        read_hf_config(bad)


@pytest.mark.parametrize("cid", ["nemotron_h-modelopt_legacy-per_tensor", "qwen3_moe-compressed-per_row"])
def test_a_model_read_dequantized_saves_as_full_precision(ckpts, tmp_path, cid):
    """``--quant none`` (how training takes it), saved: a model-dtype checkpoint without the source's
    quantization (its config nor an hf_quant_config.json), which reads back to the same logits."""
    assert_saves_as_full_precision(ckpts[cid][0], tmp_path / "saved", PROMPTS[0])


def test_the_dequantized_copy_is_written_one_stored_file_at_a_time(ckpts, tmp_path, monkeypatch):
    """transformers' model of a per-row checkpoint (``--compare``'s reference) comes from a
    dequantized copy written one shard per stored file, so host memory never holds the whole copy
    at once: the checkpoint split into two files (a weight's row scale in the other file than the
    weight) gives two shards, each of one file's tensors, and the same model bit for bit as the
    single-file checkpoint."""
    import safetensors.torch

    from moeshard.checkpoint.hf_model import load_transformers_model

    single = ckpts["qwen3_moe-compressed-per_row"][0]
    tensors = load_file(single / "model.safetensors")
    names = sorted(tensors)
    first = set(names[: len(names) // 2])
    weight = next(n for n in names if n.endswith(".weight") and tensors[n].dtype == torch.float8_e4m3fn
                  and n in first and n[: -len("weight")] + "weight_scale" not in first)
    split = tmp_path / "split"
    split.mkdir()
    parts = {"a.safetensors": {n: tensors[n] for n in names if n in first},
             "b.safetensors": {n: tensors[n] for n in names if n not in first}}
    for file, part in parts.items():
        save_file(part, str(split / file), metadata={"format": "pt"})
    (split / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: f for f, part in parts.items() for n in part}}))
    for extra in single.iterdir():
        if extra.name != "model.safetensors":
            shutil.copy(extra, split / extra.name)
    assert weight in parts["a.safetensors"] and weight[: -len("weight")] + "weight_scale" in parts["b.safetensors"]

    written: list[set[str]] = []
    save = safetensors.torch.save_file
    monkeypatch.setattr(safetensors.torch, "save_file", lambda t, *a, **k: (written.append(set(t)), save(t, *a, **k)))
    got = load_transformers_model(str(split), torch.float32).state_dict()
    assert len(written) == 2 and all(w <= set(parts["a.safetensors"]) or w <= set(parts["b.safetensors"])
                                     for w in written), [sorted(w)[:3] for w in written]
    monkeypatch.undo()
    want = load_transformers_model(str(single), torch.float32).state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
