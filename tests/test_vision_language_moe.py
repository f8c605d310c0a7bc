"""Vision-language MoE models whose text model transformers builds no causal LM of: Qwen3-VL-MoE
(``qwen3_vl_moe``, whose ``text_config`` is a ``qwen3_vl_moe_text``), GLM-4.5V (``glm4v_moe``,
``glm4v_moe_text``), DeepSeek-OCR 2 (``deepseek_ocr2``, ``deepseek_ocr2_text``: DeepSeek-V2's
block, its SAM and Qwen2 vision encoders under the release's names) and Unlimited OCR
(``unlimited_ocr``, ``unlimited_ocr_text``: the same block, its vision encoder's q, k and v stored
as one tensor); and those whose text model is a causal LM of its own, a family moeshard reads
too, while the vision-language model is another (``ModelFamily.text_config``): Aria (``aria``,
holding an ``aria_text``) and MiniMax-M3 (``minimax_m3_vl``, holding a ``minimax_m3_vl_text``);
GLM-5.3-Flash (``glm5_next``, ``glm5_next_text``) and HY-V4-VL (``hy_v4_vl``, ``hy_v4_vl_text``),
which clamp their SwiGLU, built and again with their routed and shared gate and up weights scaled
so that the clamps bite.
moeshard runs the whole image-text-to-text model (``hf_model.model_class``) with its text model's
MoE blocks replaced; the vision tower stays transformers'.

transformers is the oracle, on tiny random models saved by transformers (Qwen3-VL-MoE's experts as
it holds them, ``gate_up_rows``; GLM-4.5V's per expert, as published; Aria and MiniMax-M3 as
released, which is how transformers saves them) and on the same weights under other names:
Qwen3-VL-MoE's experts as its published checkpoints store them (transposed), and MiniMax-M3's
tensors under the whole model's own names (``-model``). fp32 logits at (1,1) within
1e-5 and greedy ids and logits under EP2, TP2 and SP; the model transformers loaded, with its
blocks swapped in memory; the router's bf16 logits bit for bit; the config read as its text
model; a stored gate_up of neither layout refused by name.
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
from generate_worlds import GenerateWorlds
from router_parity import bf16_router_parity
from safetensors.torch import load_file, save_file

from moeshard.checkpoint import load_moe_block, read_hf_config
from moeshard.checkpoint.families import FAMILIES
from moeshard.checkpoint.hf_config import parse_hf_config
from moeshard.checkpoint.hf_model import load_transformers_model
from moeshard.integrations.transformers import MoEBlock, shard_moe_blocks
from moeshard.jobs.generate import GenerateSpec, compare_generations, generate_rank, plan_generate, reference_generate
from moeshard.parallel.config import ParallelConfig

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import make_tiny_moe  # noqa: E402 - a script of this repository, importable once its directory is on the path

QWEN, GLM, ARIA, M3, GLM5, HY, OCR2, UOCR = ("qwen3_vl_moe_text", "glm4v_moe_text", "aria", "minimax_m3_vl",
                                             "glm5_next_text", "hy_v4_vl_text", "deepseek_ocr2_text", "unlimited_ocr_text")
# checkpoint -> its family; "-hub": the published layout where transformers saves another;
# "-model": the same tensors under the names the whole transformers model gives them; "-release":
# the same checkpoint with its config.json as the original release writes it (the text model's
# fields under language_config, its sliding_window at the top level).
CHECKPOINTS = {"qwen-save": QWEN, "qwen-hub": QWEN, "glm-save": GLM, "aria-save": ARIA, "m3-save": M3, "m3-model": M3,
               "glm5-save": GLM5, "hy-save": HY, "glm5-clamp": GLM5, "hy-clamp": HY, "ocr2-save": OCR2,
               "uocr-save": UOCR, "uocr-release": UOCR}
# GLM-5.3-Flash and HY-V4-VL clamp their SwiGLU at 10 (GLM-5.3-Flash's shared MLP too, HY-V4-VL's
# not): "-clamp" is "-save" with the routed and shared gate and up weights scaled up so that the
# clamps bite. Judged on one rank, whose sums are transformers' own order: these models' later
# layers (linear attention, hyper-connections) grow a rounding difference, and with weights this
# large the EP2 layout's other order of the experts' sum came out 1.4e-5 from transformers' logits.
CLAMP_SCALE = 8.0
LAYOUT_CHECKPOINTS = [name for name in CHECKPOINTS if not name.endswith(("-clamp", "-release"))]
# MiniMax-M3 with its block-sparse attention (the indexer's tensors, renamed in its checkpoints) in
# two layers: generate's reference pads each DP rank's prompts as that rank does.
TEXT_CONFIG = {M3: {"layer_types": ["minimax_m3_sparse", "full_attention", "minimax_m3_sparse"]}}
PROMPTS = ((3, 17, 42, 5, 9), (1, 2, 3), (7, 8, 9, 10), (11, 12))
NEW_TOKENS = 3
SPAWN_TIMEOUT_S = 300
# SP: the TP ranks split the rows (EP over dp * tp); EP2; TP2 (each rank a slice of I).
LAYOUTS = (ParallelConfig(2, 1, True), ParallelConfig(1, 2, False), ParallelConfig(1, 2, True))
H, I = 64, 48  # 2I != H, so the two stored layouts differ in shape


# family -> the whole model's type, which the installed transformers must know (5.17 has no HY-V4-VL).
WHOLE = {QWEN: "qwen3_vl_moe", GLM: "glm4v_moe", ARIA: ARIA, M3: M3, GLM5: "glm5_next", HY: "hy_v4_vl",
         OCR2: "deepseek_ocr2", UOCR: "unlimited_ocr"}


class _Checkpoints(dict):
    """CHECKPOINTS' directories, each made when first asked for (a test of a model type the
    installed transformers lacks is skipped): transformers' own saves ("-save"); Qwen3-VL-MoE's
    same tensors with the experts transposed, as its published checkpoints store them ("-hub");
    MiniMax-M3's under the whole model's own names ("-model"); the clamping families' with their
    gate and up weights scaled ("-clamp")."""

    def __init__(self, root: Path) -> None:
        super().__init__()
        self.root = root

    def __missing__(self, name: str) -> Path:
        family, path = CHECKPOINTS[name], self.root / name
        if not name.endswith("-save"):
            base = self[name.rsplit("-", 1)[0] + "-save"]
            shutil.copytree(base, path)
        if name.endswith("-save"):
            if WHOLE[family] not in tf.models.auto.configuration_auto.CONFIG_MAPPING_NAMES:
                pytest.skip(f"transformers {tf.__version__} has no {WHOLE[family]}")
            make_tiny_moe.make(str(path), family, hidden=H, moe_intermediate=I, experts=8, layers=3,
                               seed=list(CHECKPOINTS).index(name), text_config=TEXT_CONFIG.get(family))
        elif name.endswith("-hub"):
            tensors = load_file(path / "model.safetensors")
            for t in [t for t in tensors if t.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))]:
                tensors[t] = tensors[t].transpose(1, 2).contiguous()
            save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
        elif name.endswith("-release"):
            raw = json.loads((path / "config.json").read_text())
            text = raw.pop("text_config")
            raw["language_config"] = {**text, "sliding_window": None, "model_type": "deepseek_v2"}
            raw["sliding_window"] = text["sliding_window"]
            (path / "config.json").write_text(json.dumps(raw, indent=2))
        elif name.endswith("-clamp"):
            tensors = load_file(path / "model.safetensors")
            for t in [t for t in tensors if ".mlp." in t and t.endswith(
                    ("gate_proj.weight", "up_proj.weight", "experts.gate_up_proj", "linear_gate.weight"))]:
                tensors[t] = tensors[t] * CLAMP_SCALE
            save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
        else:  # "-model"
            model = load_transformers_model(str(path), torch.float32)
            held = {n: t.contiguous() for n, t in model.state_dict().items()}
            assert any(n.startswith("model.language_model.layers.") for n in held)
            save_file(held, str(path / "model.safetensors"), metadata={"format": "pt"})
        self[name] = path
        return path

    def available(self, name: str) -> bool:
        try:
            self[name]
        except pytest.skip.Exception:
            return False
        return True


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> _Checkpoints:
    return _Checkpoints(tmp_path_factory.mktemp("vl-moe"))


def _plan(model_dir: Path, layout: ParallelConfig | None = None, dtype: str = "float32"):
    return plan_generate(GenerateSpec(str(model_dir), PROMPTS, NEW_TOKENS, layout or ParallelConfig(), dtype=dtype,
                                      compare=True))


@pytest.mark.parametrize("name, dense, renormalize, shared", [("qwen-save", [1], True, 0), ("glm-save", [0], True, 1),
                                                         ("aria-save", [], False, 1), ("m3-save", [0], True, 1),
                                                         ("glm5-save", [0], True, 1), ("hy-save", [0], True, 1),
                                                         ("ocr2-save", [0], False, 1), ("uocr-save", [0], False, 1),
                                                         ("uocr-release", [0], False, 1)])
def test_the_config_is_read_as_its_text_model(models, name, dense, renormalize, shared):
    """Qwen3-VL-MoE: layer 1 dense (``mlp_only_layers``), always renormalized (its text config has
    no norm_topk_prob); GLM-4.5V: layer 0 dense (``first_k_dense_replace``), a shared expert;
    Aria: every layer MoE, softmax over the chosen, a shared expert; MiniMax-M3, GLM-5.3-Flash:
    layer 0 dense (``mlp_layer_types``), a shared expert; HY-V4-VL: layer 0 dense (its default),
    a shared expert; DeepSeek-OCR 2: layer 0 dense (``mlp_layer_types``), never renormalized
    (DeepSeek-V2's block), a shared expert, and Unlimited OCR alike, also from the original
    release's ``language_config``. Aria and MiniMax-M3 keep the whole model's type."""
    info = read_hf_config(models[name])
    assert info.model_type == CHECKPOINTS[name] and info.num_layers == 3
    assert info.source.endswith("config.json: language_config" if name.endswith("-release") else "config.json: text_config")
    assert [layer for layer in range(3) if layer in info.dense_layers] == dense
    cfg = info.moe
    assert (cfg.num_experts, cfg.top_k, cfg.hidden_size, cfg.intermediate_size) == (8, 2, H, I)
    assert cfg.renormalize == renormalize and cfg.num_shared_experts == shared


def test_a_vision_language_family_without_a_text_config_is_refused_by_name():
    with pytest.raises(ValueError, match=r"^config\.json: model_type 'aria' holds its text model's fields in "
                                         r"text_config, which must be an object; got NoneType$"):
        parse_hf_config({"model_type": "aria", "hidden_size": 64})


def test_the_release_config_is_read_as_transformers_reads_it(models):
    """Unlimited OCR's original config.json: the text model's fields under ``language_config`` (its
    ``model_type`` there is not the text family's, which transformers' config class ignores; the
    ``sliding_window`` at the top level, where transformers' config class finds it); a
    ``text_config`` beside it wins, as in transformers; without either the error names the key."""
    release = json.loads((models["uocr-release"] / "config.json").read_text())
    save = json.loads((models["uocr-save"] / "config.json").read_text())
    assert parse_hf_config(release).moe == parse_hf_config(save).moe
    assert tf.AutoConfig.for_model(**release).text_config.sliding_window == save["text_config"]["sliding_window"]
    both = {**release, "text_config": save["text_config"], "language_config": {"hidden_size": 8}}
    assert parse_hf_config(both).moe == parse_hf_config(save).moe
    del release["language_config"]
    with pytest.raises(ValueError, match=r"^config\.json: model_type 'unlimited_ocr' without a text_config holds its "
                                         r"text model's fields in language_config, which must be an object; got "
                                         r"NoneType$"):
        parse_hf_config(release)
    with pytest.raises(ValueError, match=r"release_text_config: expected None or \(whole model_type"):
        replace(FAMILIES[UOCR], release_text_config=("unlimited_ocr", ("language_config",)))


def test_a_text_config_family_needs_the_whole_models_layers():
    assert FAMILIES["aria"].model_layers == "model.language_model.layers"  # the text model's, by default
    with pytest.raises(ValueError, match=r"ModelFamily\('aria'\)\.text_config: expected a bool, and model_layers or "
                                         r"text_model"):
        replace(FAMILIES["aria"], model_layers=None, text_model=None)


def test_the_whole_models_names_map_onto_the_checkpoints():
    """Hand-checked: the text model's tensors under the causal LM's ``model.`` (``text_model``),
    then the release's names (``dense_renames``) or parts (``dense_concat``), each only where
    the checkpoint lacks the name before it."""
    m3 = FAMILIES[M3]
    held = {"model.layers.0.self_attn.index_q_proj.weight", "model.layers.0.mlp.gate_proj.weight",
            "model.layers.0.mlp.up_proj.weight", "model.norm.weight", "patch_merge_mlp.linear_1.weight",
            "vision_tower.vision_model.encoder.layers.0.mlp.fc1.weight", "model.vision_tower.pre_layrnorm.weight"}
    sources = {name: m3.dense_sources(name, held.__contains__) for name in (
        "model.language_model.layers.0.self_attn.indexer.q_proj.weight", "model.language_model.layers.0.mlp.gate_up_proj.weight",
        "model.language_model.norm.weight", "model.multi_modal_projector.merge_linear_1.weight",
        "model.vision_tower.layers.0.mlp.fc1.weight", "model.vision_tower.pre_layrnorm.weight", "lm_head.weight")}
    assert sources == {
        "model.language_model.layers.0.self_attn.indexer.q_proj.weight": ("model.layers.0.self_attn.index_q_proj.weight",),
        "model.language_model.layers.0.mlp.gate_up_proj.weight": ("model.layers.0.mlp.gate_proj.weight",
                                                                  "model.layers.0.mlp.up_proj.weight"),
        "model.language_model.norm.weight": ("model.norm.weight",),
        "model.multi_modal_projector.merge_linear_1.weight": ("patch_merge_mlp.linear_1.weight",),
        "model.vision_tower.layers.0.mlp.fc1.weight": ("vision_tower.vision_model.encoder.layers.0.mlp.fc1.weight",),
        "model.vision_tower.pre_layrnorm.weight": ("model.vision_tower.pre_layrnorm.weight",),  # held as the model names it
        "lm_head.weight": ("lm_head.weight",),
    }
    fused = m3.dense_sources("model.language_model.layers.0.mlp.gate_up_proj.weight",
                             {"model.layers.0.mlp.gate_up_proj.weight"}.__contains__)
    assert fused == ("model.layers.0.mlp.gate_up_proj.weight",)  # a checkpoint of the model's own names


def test_both_stored_layouts_read_the_same_experts(models):
    save, hub = (load_moe_block(models[k], 0).local_experts for k in ("qwen-save", "qwen-hub"))
    assert torch.equal(save.gate_up, hub.gate_up) and torch.equal(save.down, hub.down)
    assert load_moe_block(models["qwen-hub"], 0).names.fused_layout == "transposed"
    assert load_moe_block(models["qwen-save"], 0).names.fused_layout == "gate_up_rows"


def test_both_namings_read_the_same_block(models):
    """MiniMax-M3 as released (per-expert ``w1`` / ``w3`` / ``w2`` under ``block_sparse_moe``, the
    shared expert's gate and up apart) and under the whole model's names (fused, under ``mlp``):
    the same experts, router, selection bias and shared expert."""
    released, held = (load_moe_block(models[f"m3-{k}"], 1) for k in ("save", "model"))
    assert torch.equal(released.local_experts.gate_up, held.local_experts.gate_up)
    assert torch.equal(released.local_experts.down, held.local_experts.down)
    for name in ("gate", "correction_bias", "shared_gate", "shared_up", "shared_down"):
        a, b = getattr(released.weights, name), getattr(held.weights, name)
        assert (a is None and b is None) or torch.equal(a, b), name
    assert released.weights.shared_gate is not None


@pytest.mark.parametrize("which", CHECKPOINTS)
def test_one_rank_logits_equal_transformers(models, which):
    plan = _plan(models[which])
    assert plan.model_type == CHECKPOINTS[which]
    c = compare_generations(plan, [generate_rank(plan, None)], reference_generate(plan))
    assert all(c.same_ids), f"ids differ at steps {c.first_difference}"
    assert c.within_tolerance, f"logits off by {c.step_max_abs}"


# make test runs EP2 and TP2 on the published layouts; make test-slow SP and transformers' own save.
FAST = {("dp2-tp1-ep", "qwen-hub"), ("dp1-tp2-noep", "qwen-hub"), ("dp2-tp1-ep", "glm-save"),
        ("dp1-tp2-noep", "glm-save"), ("dp2-tp1-ep", "aria-save"), ("dp1-tp2-noep", "m3-save"),
        ("dp1-tp2-noep", "glm5-save"), ("dp2-tp1-ep", "hy-save"), ("dp1-tp2-noep", "ocr2-save"),
        ("dp2-tp1-ep", "uocr-save")}


@pytest.fixture(scope="module")
def world(models):
    def cases(slow: bool):
        chosen = [(layout, which) for layout in LAYOUTS for which in LAYOUT_CHECKPOINTS
                  if ((layout.name, which) in FAST) != slow and models.available(which)]
        return ([(layout.name, which) for layout, which in chosen],
                [_plan(models[which], layout) for layout, which in chosen])

    worlds = GenerateWorlds(cases, SPAWN_TIMEOUT_S)
    return lambda slow: worlds(slow)


@pytest.mark.parametrize("layout, which", [
    pytest.param(layout.name, which, marks=() if (layout.name, which) in FAST else (pytest.mark.slow,))
    for layout in LAYOUTS for which in LAYOUT_CHECKPOINTS])
def test_layout_generates_what_transformers_generates(models, world, layout, which):
    models[which]  # skips a model type the installed transformers lacks
    plan, results = world((layout, which) not in FAST)[(layout, which)]
    for r in results:
        assert not isinstance(r, dict), f"rank raised: {r}"
    c = compare_generations(plan, results, reference_generate(plan))
    assert all(c.same_ids), f"{layout}: ids differ at steps {c.first_difference}"
    assert c.within_tolerance, f"{layout}: logits off by {c.step_max_abs}"


@pytest.mark.parametrize("which, blocks, cls", [("qwen-hub", 2, "Qwen3VLMoeForConditionalGeneration"),
                                                ("glm-save", 2, "Glm4vMoeForConditionalGeneration"),
                                                ("aria-save", 3, "AriaForConditionalGeneration"),
                                                ("m3-model", 2, "MiniMaxM3SparseForConditionalGeneration"),
                                                ("glm5-save", 2, "Glm5NextForConditionalGeneration"),
                                                ("hy-save", 2, "HYV4VLForConditionalGeneration"),
                                                ("ocr2-save", 2, "DeepseekOcr2ForConditionalGeneration"),
                                                ("uocr-save", 2, "UnlimitedOcrForConditionalGeneration")])
def test_the_loaded_model_with_its_blocks_swapped_in_memory(models, which, blocks, cls):
    model = load_transformers_model(str(models[which]), torch.float32).eval()
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        before = model(ids).logits
        shard_moe_blocks(model, None)
        after = model(ids).logits
    assert len([m for m in model.modules() if isinstance(m, MoEBlock)]) == blocks  # one of three layers is dense
    assert type(model).__name__ == cls
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("which", [name for name in CHECKPOINTS if name.endswith("-save")])
def test_the_vision_tower_is_read_as_transformers_reads_it(models, which):
    """Text-only logits do not depend on the vision tower, so they cannot prove its renames and
    splits: every tensor of the model outside the text model, as moeshard loads it, equals the one
    transformers loads (the OCR models' SAM encoders under the release's names, Unlimited OCR's
    vision attention split from its stored qkv_proj; a vision embedding's position table that
    transformers' initialisation of its position ids had overwritten)."""
    from moeshard.integrations.transformers import load_sharded_model

    ours = load_sharded_model(str(models[which])).state_dict()
    theirs = load_transformers_model(str(models[which]), torch.float32).state_dict()
    text = ("model.language_model.", "lm_head.", "language_model.")
    vision = [n for n in theirs if not n.startswith(text) and "experts" not in n]
    assert vision
    if which == "uocr-save":
        assert any(n.endswith("encoder.layers.0.self_attn.k_proj.weight") for n in vision)
    for name in vision:
        assert torch.equal(ours[name], theirs[name]), name


@pytest.mark.parametrize("which, router_dtype", [("qwen-save", "model"), ("glm-save", "fp32"), ("aria-save", "model"),
                                                 ("m3-save", "model"), ("glm5-save", "fp32"), ("hy-save", "fp32"),
                                                 ("ocr2-save", "fp32"), ("uocr-save", "fp32")])
def test_bf16_router_is_transformers_router(models, which, router_dtype):
    parity = bf16_router_parity(tf, str(models[which]))
    assert parity.logits_differ == parity.ids_differ == parity.biases_differ == 0, parity
    assert (parity.fp32_logits_differ > 0) == (router_dtype == "model"), parity


@pytest.mark.parametrize("which, field, activation", [("glm5-clamp", "shared_activation", "silu"),
                                                      ("glm5-clamp", "activation", "silu"),
                                                      ("hy-clamp", "activation", "silu"),
                                                      ("hy-clamp", "shared_activation", "silu_clamped")])
def test_the_clamps_bite(models, monkeypatch, which, field, activation):
    """Planted fault: the family read with the other activation for its routed or its shared
    experts (GLM-5.3-Flash's shared MLP unclamped, HY-V4-VL's clamped) no longer gives
    transformers' logits, so the checkpoints' scale makes each clamp matter."""
    family = FAMILIES[CHECKPOINTS[which]]
    monkeypatch.setitem(FAMILIES, family.model_type,
                        replace(family, moe=lambda f: replace(family.moe(f), **{field: activation})))
    plan = _plan(models[which])
    c = compare_generations(plan, [generate_rank(plan, None)], reference_generate(plan))
    seen = [d for d in c.step_max_abs if d is not None]  # none past a step whose ids differ
    assert not all(c.same_ids) or max(seen) > 1e-3, c


def test_a_stored_gate_up_of_neither_layout_is_refused(models, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(models["qwen-hub"], bad)
    tensors = load_file(bad / "model.safetensors")
    name = "model.language_model.layers.0.mlp.experts.gate_up_proj"
    tensors[name] = tensors[name][:, :, :-2].contiguous()
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"tensor 'model\.layers\.0\.mlp\.experts\.gate_up_proj' .* has shape "
                                         r"\[8, 64, 94\], expected \[8, 96, 64\]"):
        load_moe_block(bad, 0)
