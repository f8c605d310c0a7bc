"""A new model family is one descriptor: ``toy_mixtral`` below is Mixtral renamed (its block under
``moe.``, its router ``router``, w1/w3/w2 experts, top-k-then-softmax routing), registered from
this module as data. It loads through the checkpoint reader and, as an in-memory model, through
the transformers integration's ``shard_moe_blocks``; nothing in the package knows its names."""

import json
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from moeshard.checkpoint import families, load_moe_block
from moeshard.checkpoint.families import W1_W3_W2, register_family, unregister_family
from moeshard.integrations.transformers import MoEBlock, shard_moe_blocks
from moeshard.layer import MoELayer
from moeshard.reference import reference_forward
from moeshard.tolerances import compare
from moeshard.weights import MoEWeights

E, K, H, I = 4, 2, 16, 32
TOY = replace(families.FAMILIES["mixtral"], model_type="toy_mixtral", routing="topk_softmax",
              block_prefixes=("moe.",), router="router", expert_spellings=(W1_W3_W2,), formats=("bf16",))
CONFIG = {"model_type": "toy_mixtral", "num_hidden_layers": 1, "hidden_size": H, "intermediate_size": I,
          "num_local_experts": E, "num_experts_per_tok": K, "hidden_act": "silu"}


@pytest.fixture
def toy():
    register_family(TOY)
    yield TOY
    unregister_family(TOY.model_type)


def _weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"router": torch.randn(E, H, generator=g) / 2, "gate_up": torch.randn(E, 2 * I, H, generator=g) / 4,
            "down": torch.randn(E, H, I, generator=g) / 6}


def test_the_family_is_refused_until_registered_and_refused_twice(toy):
    with pytest.raises(ValueError, match="registered already"):
        register_family(toy)


def test_a_registered_family_loads_through_the_checkpoint_reader(toy, tmp_path):
    w = _weights()
    p = "model.layers.0.moe."
    tensors = {p + "router.weight": w["router"]}
    for e in range(E):
        gate, up = w["gate_up"][e].chunk(2)
        tensors |= {f"{p}experts.{e}.w1.weight": gate, f"{p}experts.{e}.w3.weight": up,
                    f"{p}experts.{e}.w2.weight": w["down"][e]}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    block = load_moe_block(tmp_path, 0)
    assert block.cfg.scoring == "topk_softmax" and block.names.prefix == p and block.names.router == p + "router.weight"
    assert torch.equal(block.local_experts.gate_up, w["gate_up"]) and torch.equal(block.local_experts.down, w["down"])
    layer = MoELayer(block.cfg, weights=block.weights, local_experts=block.local_experts)
    x = torch.randn(9, H, generator=torch.Generator().manual_seed(1))
    full = MoEWeights(gate=w["router"], gate_up=w["gate_up"], down=w["down"])
    assert compare(layer(x), reference_forward(x, full, block.cfg), block.cfg.dtype, "none")[3]
    unregister_family(toy.model_type)
    with pytest.raises(ValueError, match="model_type 'toy_mixtral' is not supported"):
        load_moe_block(tmp_path, 0)


class _Experts(nn.Module):
    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        super().__init__()
        self.gate_up_proj, self.down_proj = nn.Parameter(gate_up), nn.Parameter(down)


class _Block(nn.Module):
    def __init__(self, w: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.router = nn.Linear(H, E, bias=False)
        self.router.weight = nn.Parameter(w["router"].clone())
        self.experts = _Experts(w["gate_up"].clone(), w["down"].clone())


class _Layer(nn.Module):
    def __init__(self, w: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.moe = _Block(w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.moe(x)


class _Decoder(nn.Module):
    def __init__(self, w: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Layer(w)])


class _CausalLM(nn.Module):
    """Stands in for a transformers model of the toy family: ``config.to_dict()``,
    ``model.layers[L].moe`` holding ``router`` and fused ``experts``."""

    def __init__(self, w: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.config = SimpleNamespace(to_dict=lambda: dict(CONFIG))
        self.model = _Decoder(w)


def test_a_registered_family_shards_through_the_transformers_integration(toy):
    w = _weights()
    model = shard_moe_blocks(_CausalLM(w))
    block = model.model.layers[0].moe
    assert isinstance(block, MoEBlock) and block.router_name == "router" and "gate" not in dict(block.named_children())
    x = torch.randn(2, 5, H, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        y = model.model.layers[0](x)
    full = MoEWeights(gate=w["router"], gate_up=w["gate_up"], down=w["down"])
    assert compare((y - x).reshape(-1, H), reference_forward(x.reshape(-1, H), full, block.cfg), torch.float32,
                   "none")[3]
    assert "router.weight" in dict(block.named_parameters())


def test_tensors_outside_the_blocks_stored_under_other_names():
    """``dense_renames`` and ``dense_concat`` (Kimi-Linear's attention): a model tensor is read
    under its own name where the checkpoint holds it, else renamed, or from parts concatenated
    along dim 0; a descriptor with malformed entries is refused naming the field."""
    fam = replace(TOY, dense_renames=(("attn.gate.", "attn."), (".mlp.", ".moe.")),
                  dense_concat={"attn.conv.weight": ("attn.q_conv.weight", "attn.k_conv.weight")})
    held = {"layers.0.attn.f.weight", "layers.0.moe.up.weight", "layers.1.mlp.up.weight"}
    assert fam.dense_sources("layers.0.attn.gate.f.weight", held.__contains__) == ("layers.0.attn.f.weight",)
    assert fam.dense_sources("layers.0.mlp.up.weight", held.__contains__) == ("layers.0.moe.up.weight",)
    assert fam.dense_sources("layers.1.mlp.up.weight", held.__contains__) == ("layers.1.mlp.up.weight",)  # its own
    assert fam.dense_sources("layers.2.mlp.up.weight", held.__contains__) == ("layers.2.moe.up.weight",)  # message
    assert fam.dense_sources("layers.0.attn.conv.weight", held.__contains__) == ("layers.0.attn.q_conv.weight",
                                                                              "layers.0.attn.k_conv.weight")
    assert fam.dense_sources("norm.weight", held.__contains__) == ("norm.weight",)
    with pytest.raises(ValueError, match=r"ModelFamily\('toy_mixtral'\).dense_renames: expected \(model part, stored "
                                         r"part\) pairs of names, or \(re.Pattern, template or function of the match\), "
                                         r"got \[\('attn.gate.',\)\]"):
        replace(TOY, dense_renames=(("attn.gate.",),))
    with pytest.raises(ValueError, match=r"ModelFamily\('toy_mixtral'\).dense_concat: expected \{model name ending: "
                                         r"two or more stored name endings\}"):
        replace(TOY, dense_concat={"attn.conv.weight": ("attn.q_conv.weight",)})


def test_a_stored_tensor_split_into_model_tensors(tmp_path):
    """``dense_split`` (LaraMini's fused in_proj): each model tensor is its row range of the stored
    tensor, the ranges in the listed order, their lengths the model tensors' own."""
    from moeshard.checkpoint.reader import SafetensorsCheckpoint
    from moeshard.integrations.transformers import _read_split

    fam = replace(TOY, dense_split={"attn.in_proj.weight": ("attn.in_qkv.weight", "attn.in_z.weight",
                                                            "attn.in_a.weight")})
    assert fam.dense_split_of("model.layers.3.attn.in_z.weight") == (
        "model.layers.3.attn.in_proj.weight", ("model.layers.3.attn.in_qkv.weight", "model.layers.3.attn.in_z.weight",
                                         "model.layers.3.attn.in_a.weight"))
    assert fam.dense_split_of("model.layers.3.attn.out.weight") is None
    fused = torch.arange(9 * 2, dtype=torch.float32).reshape(9, 2)
    save_file({"model.layers.3.attn.in_proj.weight": fused}, str(tmp_path / "model.safetensors"))
    ckpt = SafetensorsCheckpoint(tmp_path)
    shapes = {"model.layers.3.attn.in_qkv.weight": (6, 2), "model.layers.3.attn.in_z.weight": (2, 2),
              "model.layers.3.attn.in_a.weight": (1, 2)}
    split = fam.dense_split_of("model.layers.3.attn.in_z.weight")
    assert split is not None
    held: dict = {}
    got = {n: _read_split(ckpt, n, split, shapes, torch.float32, False, held) for n in shapes}
    assert torch.equal(torch.cat(list(got.values())), fused) and torch.equal(got["model.layers.3.attn.in_z.weight"], fused[6:8])
    assert not held  # dropped once every part was taken
    with pytest.raises(ValueError, match=r"has shape \[9, 2\], expected \[10, 2\]"):
        _read_split(ckpt, "model.layers.3.attn.in_z.weight", split, {**shapes, "model.layers.3.attn.in_a.weight": (2, 2)},
                    torch.float32, False, {})
