"""Vision-language checkpoints of a supported text family (Qwen3.5-MoE's ``qwen3_5_moe``, Qwen4-Exp's
``qwen4_exp``, Llama 4's ``llama4``, dots3's ``dots3_note``): config.json holds the text model's config as
``text_config``, and the checkpoint keeps the text model under a ``language_model`` part (dots3_note: under
the causal LM's own names, beside its vision and audio encoders). transformers' ``AutoModelForCausalLM`` loads such a
directory as the text causal LM; moeshard reads it the same way (``hf_config.text_model_config``,
``SafetensorsCheckpoint``'s causal-LM names), so the published checkpoints of these families load
without re-saving. Each tiny model is transformers' own vision-language class, saved with
``save_pretrained``; transformers' causal LM of the same directory is the judge.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from safetensors import safe_open

from moeshard.checkpoint import load_moe_block, read_hf_config
from moeshard.checkpoint.reader import SafetensorsCheckpoint
from moeshard.jobs.generate import GenerateSpec, compare_generations, generate_plans, plan_generate, reference_generate
from moeshard.parallel.config import ParallelConfig
from moeshard.parallel.spawn import spawn

tf = pytest.importorskip("transformers")
from huggingface_hub.errors import StrictDataclassError  # noqa: E402 - a config class's own validation

TEXT = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, initializer_range=0.2, pad_token_id=0, bos_token_id=1, eos_token_id=2)
# model_type -> (vision-language class, config class, text config beyond TEXT, the other parts' configs)
MODELS = {
    "qwen3_5_moe": ("Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeConfig",
                    dict(intermediate_size=48, moe_intermediate_size=16, shared_expert_intermediate_size=24,
                         num_experts=4, num_experts_per_tok=2, layer_types=["linear_attention", "full_attention"],
                         linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8,
                         linear_value_head_dim=8),
                    dict(vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2,
                                            out_hidden_size=32))),
    "qwen4_exp": ("Qwen4ExpForConditionalGeneration", "Qwen4ExpConfig",
                  dict(intermediate_size=48, moe_intermediate_size=16, shared_expert_intermediate_size=24,
                       num_experts=4, num_experts_per_tok=2, hc_count=2, hc_lowrank=8,
                       layer_types=["linear_attention", "indexed_attention"], indexer_n_heads=2, indexer_kv_heads=1,
                       indexer_head_dim=8, indexer_budget=8, indexer_compress_ratio=4, linear_num_value_heads=4,
                       linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8),
                  dict(vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2,
                                          out_hidden_size=32))),
    "llama4": ("Llama4ForConditionalGeneration", "Llama4Config",
               dict(intermediate_size=16, intermediate_size_mlp=48, num_local_experts=4, num_experts_per_tok=1,
                    interleave_moe_layer_step=1, no_rope_layers=[1, 1]),
               dict(vision_config=dict(hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                                       image_size=28, patch_size=14, vision_output_dim=16, projector_input_dim=16,
                                       projector_output_dim=32))),
    "dots3_note": ("Dots3NoteForConditionalGeneration", "Dots3NoteConfig",
                   dict(num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                        v_head_dim=8, head_dim=16, intermediate_size=48, moe_intermediate_size=16,
                        shared_experts_intermediate_size=24, n_routed_experts=4, num_experts_per_tok=2,
                        n_shared_experts=1, index_topk=4, index_head_dim=16, index_n_heads=2,
                        mlp_layer_types=["sparse", "sparse"], sliding_window=8),
                   # Both encoders' adapters must end at the text model's width (the config refuses others).
                   dict(vision_config=dict(hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                                           moe_intermediate_size=8, num_local_experts=2, mlp_layer_types=["dense"],
                                           adapter_in_dim=16, adapter_out_dim=32, per_layer_config={}),
                        audio_config=dict(hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                                          num_key_value_heads=2, head_dim=8, downsample_hidden_size=8,
                                          adapter_input_size=16, adapter_out_dim=32, conv_output_size=48,
                                          feature_size=16))),
}
# The stored name of a text-model tensor, per model type (the causal LM's is model.layers.0....).
STORED_ROUTER = {"qwen3_5_moe": "model.language_model.layers.0.mlp.gate.weight",
                 "qwen4_exp": "model.language_model.layers.0.mlp.gate.weight",
                 "llama4": "language_model.model.layers.0.feed_forward.router.weight",
                 "dots3_note": "model.layers.0.mlp.gate.weight"}
PROMPTS = ((3, 17, 42, 5, 9), (1, 2, 3))


@dataclass(frozen=True)
class Built:
    """The saved models: ``built(model_type)`` is one's directory, or skips the test calling it."""

    dirs: dict[str, str]

    def __call__(self, model_type: str) -> str:
        if model_type not in self.dirs:
            pytest.skip(f"transformers {tf.__version__} has no {MODELS[model_type][0]}")
        return self.dirs[model_type]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Built:
    """model_type -> directory of its tiny vision-language model; a test of a model this transformers
    lacks is skipped here."""
    root = tmp_path_factory.mktemp("tiny-vl")
    out = {}
    for seed, (model_type, (model_class, config_class, text, parts)) in enumerate(MODELS.items()):
        if not (hasattr(tf, model_class) and hasattr(tf, config_class)):
            continue
        torch.manual_seed(seed)
        try:
            config = getattr(tf, config_class)(text_config={**TEXT, **text}, **parts)
        except StrictDataclassError:  # a config class of another shape (transformers 5.17's Qwen4-Exp)
            continue
        getattr(tf, model_class)(config).eval().save_pretrained(root / model_type)
        out[model_type] = str(root / model_type)
    return Built(out)


@pytest.mark.parametrize("model_type", list(MODELS))
def test_the_text_model_is_read_under_the_causal_lms_names(models, model_type):
    model_dir = models(model_type)
    info = read_hf_config(model_dir)
    assert info.model_type == f"{model_type}_text" and info.source.endswith("config.json: text_config")
    ckpt = SafetensorsCheckpoint(model_dir)
    names = ckpt.names()
    assert not any("language_model" in n for n in names)  # every text-model tensor under the causal LM's name
    assert any(n.startswith(("model.visual.", "vision_model.", "vision_encoder.")) for n in names)  # the vision tower's own
    router = STORED_ROUTER[model_type].replace("model.language_model.", "model.").replace("language_model.model.",
                                                                                           "model.")
    assert ckpt.stored_name(router) == STORED_ROUTER[model_type]
    assert ckpt.info(router).name == router
    with safe_open(ckpt.info(router).file, "pt") as f:  # the stored tensor, read by its stored name
        assert torch.equal(ckpt.read_many([(router, ())])[0], f.get_tensor(STORED_ROUTER[model_type]))
    block = load_moe_block(model_dir, 0)
    assert block.cfg.num_experts == 4


@pytest.mark.parametrize("model_type", list(MODELS))
def test_one_rank_logits_equal_transformers_causal_lm(models, model_type):
    """fp32 at (1,1): the logits of transformers' causal LM of the same directory within 1e-5, every
    MoE block moeshard's."""
    from moeshard.integrations.transformers import MoEBlock, load_sharded_model

    model_dir = models(model_type)
    ids = torch.tensor([list(PROMPTS[0]), [1, 2, 3, 4, 5]])
    want = tf.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    got = load_sharded_model(model_dir)
    assert type(got) is type(want)
    assert sum(isinstance(m, MoEBlock) for m in got.modules()) == 2
    with torch.no_grad():
        a, b = got(ids).logits, want(ids).logits
    assert float(b.abs().max()) > 1e-2  # logits that can differ (not a near-zero random model)
    assert torch.allclose(a, b, atol=1e-5, rtol=1e-5), (a - b).abs().max()


def test_ep2_generates_what_transformers_generates(models):
    """Both models under EP2 on two CPU ranks, in one spawn: transformers' greedy ids."""
    present = list(models.dirs)
    if not present:
        pytest.skip(f"transformers {tf.__version__} has neither vision-language class")
    plans = [plan_generate(GenerateSpec(models(t), PROMPTS, 4, ParallelConfig(2, 1, True), compare=True))
             for t in present]
    per_rank = spawn(generate_plans, 2, args=(plans,), timeout_s=300.0, preload=("moeshard.jobs.generate",))
    for i, plan in enumerate(plans):
        results = [per_rank[r][i] for r in range(2)]
        c = compare_generations(plan, results, reference_generate(plan))
        assert all(c.same_ids) and c.within_tolerance, (present[i], c.first_difference, c.step_max_abs)


def test_text_model_names_refuse_a_clash_and_leave_a_text_checkpoint_alone(tmp_path):
    """Hand-made files: a name the text model would take that the checkpoint also holds is refused
    (which tensor is meant is not clear); a checkpoint holding model.layers.* is read as stored,
    whatever else it holds."""
    from safetensors.torch import save_file

    t = torch.zeros(2)
    clash = tmp_path / "clash"
    clash.mkdir()
    save_file({"model.language_model.norm.weight": t, "model.norm.weight": t.clone()}, clash / "model.safetensors")
    with pytest.raises(ValueError, match=r"holds both 'model.language_model.norm.weight' and 'model.norm.weight', "
                                         r"the causal LM's name of the first"):
        SafetensorsCheckpoint(clash)
    text = tmp_path / "text"
    text.mkdir()
    save_file({"model.layers.0.mlp.gate.weight": t, "language_model.model.norm.weight": t.clone()},
              text / "model.safetensors")
    assert SafetensorsCheckpoint(text).names() == ["language_model.model.norm.weight", "model.layers.0.mlp.gate.weight"]


@pytest.mark.parametrize("raw", [{"model_type": {"quant_method": "fp8"}},
                                 {"model_type": "vl", "text_config": {"model_type": ["qwen3_5_moe_text"]}},
                                 {"model_type": "vl", "text_config": "qwen3_5_moe_text"}])
def test_a_malformed_model_type_is_refused_by_name(raw):
    """A model type that is no string (here or in text_config) is refused as unsupported, naming
    the value: the text-config lookup must not fail on it first (hypothesis found a dict there
    raising TypeError: unhashable)."""
    from moeshard.checkpoint import parse_hf_config

    with pytest.raises(ValueError, match=r"config.json: model_type .* is not supported; supported: \["):
        parse_hf_config(raw, "config.json")
