"""Mistral Small 4 (``mistral4``): DeepSeek-V3's block under a softmax router that groups its
experts and computes every step in the model dtype (routing kind ``softmax_group_model``), in a
causal LM transformers lists under its image-text-to-text auto class only.

transformers is the oracle, on a tiny random model it saved (``make_tiny_moe``: 8 experts in 4
groups, the best 2 kept, routed scaling 1.5, one shared expert, the first layer dense): the
config read with its groups and dense layer; fp32 logits of every greedy step at (1,1) within
1e-5, and greedy ids and logits under EP2, TP2 and SP; the model transformers loaded, with its
blocks swapped in memory; in bf16 the router's logits, experts and weights bit for bit, with the
fp32 logits of ``router_dtype="fp32"`` differing.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import transformers as tf
from generate_worlds import GenerateWorlds
from router_parity import bf16_router_parity

from moeshard.checkpoint import read_hf_config
from moeshard.checkpoint.hf_config import parse_hf_config
from moeshard.checkpoint.hf_model import load_transformers_model
from moeshard.integrations.transformers import MoEBlock, shard_moe_blocks
from moeshard.jobs.generate import GenerateSpec, compare_generations, generate_rank, plan_generate, reference_generate
from moeshard.parallel.config import ParallelConfig

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import make_tiny_moe  # noqa: E402 - a script of this repository, importable once its directory is on the path

PROMPTS = ((3, 17, 42, 5, 9), (1, 2, 3), (7, 8, 9, 10), (11, 12))
NEW_TOKENS = 3
SPAWN_TIMEOUT_S = 300
H, I = 64, 48
# EP2 and TP2 in make test; SP (the TP ranks split the rows, EP over dp * tp) in make test-slow.
LAYOUTS = {"dp2-tp1-ep": (ParallelConfig(2, 1, True), False), "dp1-tp2-noep": (ParallelConfig(1, 2, False), False),
           "dp1-tp2-ep": (ParallelConfig(1, 2, True), True)}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    if "mistral4" not in tf.models.auto.configuration_auto.CONFIG_MAPPING_NAMES:
        pytest.skip(f"transformers {tf.__version__} has no mistral4")
    path = tmp_path_factory.mktemp("mistral4") / "tiny"
    make_tiny_moe.make(str(path), "mistral4", hidden=H, moe_intermediate=I, experts=8, layers=3, seed=4)
    return path


def _plan(model_dir: Path, layout: ParallelConfig | None = None):
    return plan_generate(GenerateSpec(str(model_dir), PROMPTS, NEW_TOKENS, layout or ParallelConfig(), dtype="float32",
                                      compare=True))


def test_the_config_is_read_with_its_groups_and_dense_layer(model_dir):
    info = read_hf_config(model_dir)
    cfg = info.moe
    assert (info.model_type, info.num_layers, list(info.dense_layers)) == ("mistral4", 3, [0])
    assert (cfg.scoring, cfg.router_dtype, cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor) == \
        ("softmax_group_model", "model", 4, 2, 1.5)
    assert (cfg.num_experts, cfg.top_k, cfg.hidden_size, cfg.intermediate_size, cfg.num_shared_experts,
            cfg.shared_intermediate_size, cfg.renormalize) == (8, 2, H, I, 1, I, True)


def test_a_group_count_that_does_not_divide_the_experts_is_refused_naming_both():
    raw = dict(model_type="mistral4", hidden_size=32, moe_intermediate_size=16, num_hidden_layers=2,
               n_routed_experts=8, num_experts_per_tok=2, n_group=3, topk_group=1)
    with pytest.raises(ValueError, match=r"n_group.*3.*8|8.*n_group.*3"):
        parse_hf_config(raw, "config.json")


def test_one_rank_logits_equal_transformers(model_dir):
    plan = _plan(model_dir)
    c = compare_generations(plan, [generate_rank(plan, None)], reference_generate(plan))
    assert all(c.same_ids), f"ids differ at steps {c.first_difference}"
    assert c.within_tolerance, f"logits off by {c.step_max_abs}"


@pytest.fixture(scope="module")
def world(model_dir):
    def cases(slow: bool):
        chosen = [name for name, (_, is_slow) in LAYOUTS.items() if is_slow == slow]
        return chosen, [_plan(model_dir, LAYOUTS[name][0]) for name in chosen]

    return GenerateWorlds(cases, SPAWN_TIMEOUT_S)


@pytest.mark.parametrize("layout", [pytest.param(name, marks=(pytest.mark.slow,) if slow else ())
                                    for name, (_, slow) in LAYOUTS.items()])
def test_layout_generates_what_transformers_generates(world, layout):
    plan, results = world(LAYOUTS[layout][1])[layout]
    for r in results:
        assert not isinstance(r, dict), f"rank raised: {r}"
    c = compare_generations(plan, results, reference_generate(plan))
    assert all(c.same_ids), f"{layout}: ids differ at steps {c.first_difference}"
    assert c.within_tolerance, f"{layout}: logits off by {c.step_max_abs}"


def test_the_loaded_model_with_its_blocks_swapped_in_memory(model_dir):
    model = load_transformers_model(str(model_dir), torch.float32).eval()
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        before = model(ids).logits
        shard_moe_blocks(model, None)
        after = model(ids).logits
    assert type(model).__name__ == "Mistral4ForCausalLM"
    assert len([m for m in model.modules() if isinstance(m, MoEBlock)]) == 2  # layer 0 is dense
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)


def test_bf16_router_is_transformers_router(model_dir):
    parity = bf16_router_parity(tf, str(model_dir))
    assert parity.logits_differ == parity.ids_differ == parity.biases_differ == 0, parity
    assert parity.fp32_logits_differ > 0, parity
