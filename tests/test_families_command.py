"""``moeshard families``: every registered family and every refused model type, read from the
registry (so the listing cannot fall behind it), as tables and as JSON."""

from __future__ import annotations

import json

from moeshard.checkpoint.families import FAMILIES, REFUSED
from moeshard.cli import main


def test_families_json_lists_the_registry(capsys):
    assert main(["families", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["model_type"] for r in rows["supported"]] == list(FAMILIES)
    assert {r["model_type"]: r["reason"] for r in rows["refused"]} == REFUSED
    dbrx = next(r for r in rows["supported"] if r["model_type"] == "dbrx")
    assert (dbrx["routing"], dbrx["scores_in"], dbrx["router_logits_in"], dbrx["block"], dbrx["fused_layout"],
            dbrx["formats"]) == ("softmax_model", "model", "model", ["transformer.blocks.{L}.ffn."], "stacked", ["bf16"])
    gemma = next(r for r in rows["supported"] if r["model_type"] == "gemma4_text")
    assert (gemma["routed_by"], gemma["block"]) == ("transformers' router in the decoder layer",
                                                    ["model.layers.{L}.experts"])
    deepseek_v4 = next(r for r in rows["supported"] if r["model_type"] == "deepseek_v4")
    assert (deepseek_v4["routed_by"], deepseek_v4["block"]) == ("transformers' router in the block",
                                                                ["model.layers.{L}.mlp.experts",
                                                                 "model.layers.{L}.ffn.experts"])
    assert dbrx["routed_by"] == "moeshard"
    assert not set(FAMILIES) & set(REFUSED)
    stored = {r["model_type"]: r["stored_fused_layouts"] for r in rows["supported"]}
    assert (stored["dbrx"], stored["inkling2_text"], stored["qwen3_vl_moe_text"]) == (
        ["stacked"], ["interleaved"], ["gate_up_rows", "transposed"])


def test_families_tables_print_each_model_type_and_the_reasons_whole(capsys):
    assert main(["families"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert f"model families moeshard reads ({len(FAMILIES)})" in out and f"model types refused ({len(REFUSED)})" in out
    for model_type in (*FAMILIES, *REFUSED):
        assert model_type in out
    assert "softmax (transformers routes)" in out
    assert "gate_up_rows, stored interleaved" in out  # Inkling 2's checkpoints
    assert "embedding tables [num_experts, hidden_size]" in out  # rich markup would have eaten the brackets
