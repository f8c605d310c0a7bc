"""``moeshard backends``: the support registry as a table (or JSON)."""

from __future__ import annotations

import json

from rich.table import Table

from moeshard.commands.check import wide_console
from moeshard.dispatch.registry import BACKENDS


def add_parser(sub) -> None:
    p = sub.add_parser("backends", help="print the dispatch backends and what they support")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run)


def registry_json() -> list[dict]:
    return [{"name": s.name, "quants": list(s.supported_quants()),
             "layouts": {"ep": "EP on (dp x tp ranks share experts; SP when tp > 1)", "no_ep": "EP off"}[s.layouts],
             "output": s.output, "quantize_before_dispatch": s.quantize_before_dispatch,
             "needs_side_group_on": list(s.side_group_on), "backward": s.backward, "summary": s.summary}
            for s in BACKENDS.values()]


def run(args) -> int:
    rows = registry_json()
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    table = Table(title="moeshard dispatch backends", header_style="bold")
    for col in ("backend", "layouts", "quants", "experts get", "quantize before dispatch", "side group", "backward",
                "how"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["name"], r["layouts"], ", ".join(r["quants"]), r["output"],
                      "yes" if r["quantize_before_dispatch"] else "no",
                      ", ".join(r["needs_side_group_on"]) or "-", "yes" if r["backward"] else "no", r["summary"])
    wide_console().print(table)
    return 0
