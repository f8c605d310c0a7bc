"""``moeshard families``: the model types this install reads (``checkpoint.families``), each with
its routing, router precision, where its block lives and the checkpoint formats it ships, and
the model types refused with the part of their block moeshard cannot express; a table or JSON."""

from __future__ import annotations

import json

from rich.markup import escape
from rich.table import Table

from moeshard.checkpoint import families as registry
from moeshard.commands.check import wide_console
from moeshard.routing import get_routing


def add_parser(sub) -> None:
    p = sub.add_parser("families", help="print the model families moeshard reads, and those it refuses and why")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.set_defaults(func=run)


def families_json() -> dict[str, list[dict]]:
    """{"supported": one row per registered model type, "refused": one per refused model type}."""
    supported = []
    for f in registry.FAMILIES.values():
        kind = get_routing(f.routing)
        # An experts_only family routes with transformers' router (in its decoder layer, or in its
        # block): moeshard runs its experts on that routing, and the "block" is the experts module.
        where = "decoder layer" if f.block_is_layer else "block"
        supported.append({"model_type": f.model_type, "routing": f.routing, "routing_summary": kind.summary,
                          "routed_by": f"transformers' router in the {where}" if f.experts_only else "moeshard",
                          "scores_in": kind.score_dtype, "router_logits_in": f.router_dtype,
                          "block": [f"{f.layers}.{{L}}.{p}{f.experts}" if f.experts_only else f"{f.layers}.{{L}}.{p}"
                                    for p in f.block_prefixes],
                          "fused_layout": f.fused_layout,
                          # the layouts its checkpoints hold the fused experts in
                          "stored_fused_layouts": [f.checkpoint_fused_layout] if f.checkpoint_fused_layout
                          else [f.fused_layout, *f.stored_fused_layouts],
                          "formats": list(f.formats)})
    refused = [{"model_type": t, "reason": why} for t, why in sorted(registry.REFUSED.items())]
    return {"supported": supported, "refused": refused}


def _layouts(row: dict) -> str:
    """The model's fused layout, and the checkpoints' where they differ ("gate_up_rows, stored
    interleaved")."""
    stored = row["stored_fused_layouts"]
    return row["fused_layout"] if stored == [row["fused_layout"]] else f"{row['fused_layout']}, stored {' or '.join(stored)}"


def run(args) -> int:
    rows = families_json()
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    table = Table(title=f"model families moeshard reads ({len(rows['supported'])})", header_style="bold",
                  caption="routing: the descriptor's kind (a family's config reader may pick another from config.json); "
                          "router logits and scores: fp32 or the model dtype; docs/transformers.md has each family's "
                          "proof")
    for col in ("model_type", "routing", "router logits", "scores", "block", "fused layout", "formats"):
        table.add_column(col)
    for r in rows["supported"]:
        routing = r["routing"] if r["routed_by"] == "moeshard" else f"{r['routing']} (transformers routes)"
        table.add_row(r["model_type"], routing, r["router_logits_in"], r["scores_in"],
                      escape(" or ".join(r["block"])), _layouts(r), ", ".join(r["formats"]))
    console = wide_console()
    console.print(table)
    refused = Table(title=f"model types refused ({len(rows['refused'])})", header_style="bold")
    refused.add_column("model_type")
    refused.add_column("what moeshard cannot express")
    for r in rows["refused"]:
        refused.add_row(r["model_type"], escape(r["reason"]))
    console.print(refused)
    return 0
