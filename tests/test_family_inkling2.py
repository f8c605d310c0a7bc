"""Inkling 2's text models (``inkling2_text``, ``inkling2_loop_text``): DeepSeek-V3's sigmoid
routing in one group, experts with a soft-capped SwiGLU (activation ``swiglu_softcapped``; on CUDA the Triton
gate_up's epilogue computes it), checkpoints under the release's names with the experts interleaved
(``checkpoint_fused_layout``), and, in the loop model, middle layers run twice per forward.

transformers is the oracle, on tiny random models it saved (``make_tiny_moe``: its save writes the
release's names), the experts drawn large enough that both soft caps bite: the config read; the
greedy ids and logits at (1,1) and under EP2, TP2 and SP, judged against float32 transformers
within 1e-5 or, where the loop model's layers grow the rounding, within twice transformers' own
float32 rounding (its distance from its float64 run); the model transformers loaded, with its
blocks swapped in memory; the router's bf16 logits bit for bit; and planted faults: the experts
read gate rows first, or with an uncapped SwiGLU, no longer give transformers' logits.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import transformers as tf
from generate_worlds import GenerateWorlds
from router_parity import bf16_router_parity

from moeshard.checkpoint import read_hf_config
from moeshard.checkpoint.families import FAMILIES
from moeshard.checkpoint.hf_config import parse_hf_config
from moeshard.checkpoint.hf_model import load_transformers_model
from moeshard.integrations.transformers import MoEBlock, shard_moe_blocks
from moeshard.jobs.generate import GenerateSpec, compare_generations, generate_rank, plan_generate, reference_generate
from moeshard.parallel.config import ParallelConfig

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import make_tiny_moe  # noqa: E402 - a script of this repository, importable once its directory is on the path

TEXT, LOOP = "inkling2_text", "inkling2_loop_text"
PROMPTS = ((3, 17, 42, 5, 9), (1, 2, 3), (7, 8, 9, 10), (11, 12))
NEW_TOKENS = 3
SPAWN_TIMEOUT_S = 300
H, I, LAYERS = 64, 48, 4
# (layout, family) -> slow: EP2 of one model and TP2 of the other in make test, the rest in make test-slow.
LAYOUTS = {"dp2-tp1-ep": ParallelConfig(2, 1, True), "dp1-tp2-noep": ParallelConfig(1, 2, False),
           "dp1-tp2-ep": ParallelConfig(1, 2, True)}
FAST = {("dp2-tp1-ep", LOOP), ("dp1-tp2-noep", TEXT)}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    names = tf.models.auto.configuration_auto.CONFIG_MAPPING_NAMES
    if TEXT not in names or LOOP not in names:
        pytest.skip(f"transformers {tf.__version__} has no Inkling 2")
    root = tmp_path_factory.mktemp("inkling2")
    for seed, family in enumerate((TEXT, LOOP)):
        make_tiny_moe.make(str(root / family), family, hidden=H, moe_intermediate=I, experts=8, layers=LAYERS,
                           seed=seed)
    return {family: root / family for family in (TEXT, LOOP)}


def _plan(model_dir: Path, layout: ParallelConfig | None = None):
    return plan_generate(GenerateSpec(str(model_dir), PROMPTS, NEW_TOKENS, layout or ParallelConfig(), dtype="float32",
                                      compare=True))


def _judge(plan, results, tag: str) -> None:
    """Same ids; logits within 1e-5 of float32 transformers, or within twice its own float32
    rounding (``compare_generations`` against its float64 run)."""
    c = compare_generations(plan, results, reference_generate(plan), reference_generate(plan, dtype=torch.float64))
    assert all(c.same_ids), f"{tag}: ids differ at steps {c.first_difference}"
    assert c.within_tolerance or c.within_noise, f"{tag}: logits off by {c.step_max_abs}, its rounding {c.dtype_noise}"


@pytest.mark.parametrize("family", [TEXT, LOOP])
def test_the_config_is_read(models, family):
    info = read_hf_config(models[family])
    cfg = info.moe
    assert (info.model_type, info.num_layers, list(info.dense_layers)) == (family, LAYERS, [])
    assert (cfg.scoring, cfg.router_dtype, cfg.activation, cfg.use_correction_bias, cfg.renormalize,
            cfg.routed_scaling_factor, cfg.num_shared_experts) == ("sigmoid", "fp32", "swiglu_softcapped", True, True,
                                                                   8.0, 0)
    assert (cfg.num_experts, cfg.top_k, cfg.hidden_size, cfg.intermediate_size) == (8, 2, H, I)


def test_the_preset_is_transformers_default_model():
    """``moeshard bench --models inkling-2`` times the experts of the model transformers'
    Inkling2TextConfig describes by default."""
    from moeshard.presets import PRESETS

    if not hasattr(tf, "Inkling2TextConfig"):
        pytest.skip(f"transformers {tf.__version__} has no Inkling 2")
    default = tf.Inkling2TextConfig()
    raw = {k: v for k, v in default.to_dict().items() if not k.startswith("_")}
    raw["model_type"] = TEXT
    assert parse_hf_config(raw, "config.json").moe == PRESETS["inkling-2"].full


def test_another_softcap_is_refused_naming_it():
    raw = dict(model_type=TEXT, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=2, n_routed_experts=4,
               num_experts_per_tok=2, mlp_gate_softcap=3.0)
    with pytest.raises(ValueError, match=r"mlp_gate_softcap=3\.0"):
        parse_hf_config(raw, "config.json")


@pytest.mark.parametrize("family", [TEXT, LOOP])
def test_one_rank_generates_what_transformers_generates(models, family):
    plan = _plan(models[family])
    _judge(plan, [generate_rank(plan, None)], family)


@pytest.mark.parametrize("family, field, value", [(TEXT, "checkpoint_fused_layout", None),
                                                  (LOOP, "checkpoint_fused_layout", None)])
def test_the_experts_read_gate_rows_first_are_wrong(models, monkeypatch, family, field, value):
    """Planted fault: the interleaved ``w13_weight`` read as transformers holds its gate_up."""
    monkeypatch.setitem(FAMILIES, family, replace(FAMILIES[family], **{field: value}))
    plan = _plan(models[family])
    c = compare_generations(plan, [generate_rank(plan, None)], reference_generate(plan))
    seen = [d for d in c.step_max_abs if d is not None]
    assert not all(c.same_ids) or max(seen) > 1e-3, c


@pytest.mark.parametrize("family", [TEXT, LOOP])
def test_the_soft_caps_bite(models, monkeypatch, family):
    """Planted fault: the experts with plain SwiGLU in place of the soft-capped one."""
    original = FAMILIES[family]
    monkeypatch.setitem(FAMILIES, family, replace(original, moe=lambda f: replace(original.moe(f), activation="silu")))
    plan = _plan(models[family])
    c = compare_generations(plan, [generate_rank(plan, None)], reference_generate(plan))
    seen = [d for d in c.step_max_abs if d is not None]
    assert not all(c.same_ids) or max(seen) > 1e-3, c


@pytest.fixture(scope="module")
def world(models):
    def cases(slow: bool):
        chosen = [(layout, family) for layout in LAYOUTS for family in (TEXT, LOOP)
                  if ((layout, family) in FAST) != slow]
        return chosen, [_plan(models[family], LAYOUTS[layout]) for layout, family in chosen]

    return GenerateWorlds(cases, SPAWN_TIMEOUT_S)


@pytest.mark.parametrize("layout, family", [
    pytest.param(layout, family, marks=() if (layout, family) in FAST else (pytest.mark.slow,))
    for layout in LAYOUTS for family in (TEXT, LOOP)])
def test_layout_generates_what_transformers_generates(world, layout, family):
    plan, results = world((layout, family) not in FAST)[(layout, family)]
    for r in results:
        assert not isinstance(r, dict), f"rank raised: {r}"
    _judge(plan, results, f"{layout} {family}")


@pytest.mark.parametrize("family, calls", [(TEXT, [1, 1, 1, 1]), (LOOP, [1, 2, 2, 1])])
def test_the_loaded_model_with_its_blocks_swapped_in_memory(models, family, calls):
    """Every layer's block replaced; the loop model's looped layers (1 and 2) call theirs once per pass."""
    model = load_transformers_model(str(models[family]), torch.float32).eval()
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        before = model(ids).logits
        shard_moe_blocks(model, None)
        blocks = [layer.mlp for layer in model.model.layers]
        assert all(isinstance(b, MoEBlock) for b in blocks)
        seen = [0] * len(blocks)
        hooks = [b.register_forward_hook(lambda *_, i=i: seen.__setitem__(i, seen[i] + 1)) for i, b in enumerate(blocks)]
        after = model(ids).logits
        for h in hooks:
            h.remove()
    assert seen == calls
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", [TEXT, LOOP])
def test_bf16_router_is_transformers_router(models, family):
    parity = bf16_router_parity(tf, str(models[family]))
    assert parity.logits_differ == parity.ids_differ == parity.biases_differ == 0, parity


def test_the_models_names_map_onto_the_release():
    """Hand-checked: the prefix and an inner rename composed; a pattern that shifts the layer
    index; a name the checkpoint holds as it is; the rebuilt tensors' sources."""
    text, loop = FAMILIES[TEXT], FAMILIES[LOOP]
    held = {"model.llm.layers.2.attn_norm.weight", "model.llm.attn_res.attn_queries.1", "model.llm.embed.weight",
            "model.llm.layers.1.attn.wq_du.weight", "model.norm.weight",
            "model.llm.layers.1.controllers.attn.down_weight"}
    sources = {name: text.dense_sources(name, held.__contains__) for name in (
        "model.layers.2.input_layernorm.weight", "model.layers.2.attention_input.query", "model.embed_tokens.weight",
        "model.layers.1.self_attn.q_proj.linear.weight", "model.norm.weight")}
    assert sources == {"model.layers.2.input_layernorm.weight": ("model.llm.layers.2.attn_norm.weight",),
                       "model.layers.2.attention_input.query": ("model.llm.attn_res.attn_queries.1",),
                       "model.embed_tokens.weight": ("model.llm.embed.weight",),
                       "model.layers.1.self_attn.q_proj.linear.weight": ("model.llm.layers.1.attn.wq_du.weight",),
                       "model.norm.weight": ("model.norm.weight",)}
    assert loop.dense_sources("model.layers.1.q_message_gate.down_proj.weight", held.__contains__) == \
        ("model.llm.layers.1.controllers.attn.down_weight",)
    assert text.dense_convert_of("lm_head.weight")[0] == ("model.llm.unembed.weight",)
    assert loop.dense_convert_of("model.message_input.query")[0] == (
        "model.llm.middle_cycle_cross_pass_queries", "model.llm.middle_cycle_cross_pass_kv_queries")
    assert text.dense_convert_of("model.message_input.query") is None


def test_malformed_descriptor_fields_are_refused_naming_them():
    text = FAMILIES[TEXT]
    with pytest.raises(ValueError, match=r"checkpoint_fused_layout and stored_fused_layouts exclude each other"):
        replace(text, stored_fused_layouts=("transposed",))
    with pytest.raises(ValueError, match=r"checkpoint_fused_layout: 'transposed' stores other shapes than 'gate_up_rows'"):
        replace(text, checkpoint_fused_layout="transposed")
    with pytest.raises(ValueError, match=r"dense_renames: expected \(model part, stored part\) pairs"):
        replace(text, dense_renames=(("model.", lambda m: "x"),))
    with pytest.raises(ValueError, match=r"dense_convert: expected \{model name: \(stored names, convert"):
        replace(text, dense_convert={"lm_head.weight": ("model.llm.unembed.weight", None)})


def test_a_stored_unembedding_too_small_for_the_head_is_refused(models, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    shutil.copytree(models[TEXT], bad)
    tensors = load_file(bad / "model.safetensors")
    tensors["model.llm.unembed.weight"] = tensors["model.llm.unembed.weight"][:100].contiguous()
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    plan = _plan(bad)
    with pytest.raises(ValueError, match=r"the stored unembedding \[100, 64\] does not hold lm_head \[248, 64\]"):
        generate_rank(plan, None)
