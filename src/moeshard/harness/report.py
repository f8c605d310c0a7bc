"""The report of a check run: a rich table, a summary, and the JSON document.

JSON schema (stable; later versions only add keys):
  {"cases": [{"id", "layout": {"dp", "tp", "ep", "sp"}, "backend", "quant", "defer_input_quant",
              "dtype", "preset", "num_experts", "top_k", "hidden", "intermediate", "shared_experts",
              "tokens": [per DP rank], "max_abs_err", "atol", "rtol", "quant_error",
              "quant_error_bound", "seconds", "status": "pass|fail|skip|error", "reason"}],
   "summary": {"total", "valid", "pass", "fail", "skip", "error", "wall_seconds", "device",
               "world_sizes", "torch"}}
"""

from __future__ import annotations

import collections
import json

import torch
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from moeshard.harness.runner import CaseOutcome
from moeshard.outputs import atomic_write_text

# Ids, reasons and the ranks' error messages are foreign text (a gloo message holds
# "[/.../pair.cc:553]", torch's "[enforce fail at alloc_cpu.cpp:127]"): they are always printed
# through rich.markup.escape, never read as markup; only our own style tags are markup.

STYLE = {"pass": "green", "fail": "bold red", "error": "bold red", "skip": "yellow"}


def case_json(o: CaseOutcome) -> dict:
    c, cfg = o.case, o.case.moe_config()
    p = c.parallel
    return {
        "id": c.id,
        "layout": {"dp": p.dp, "tp": p.tp, "ep": p.enable_ep, "sp": p.is_sequence_parallel},
        "backend": c.backend, "quant": c.quant.scheme, "defer_input_quant": c.quant.defer_input_quant,
        "dtype": c.dtype, "preset": c.preset, "num_experts": cfg.num_experts, "top_k": cfg.top_k,
        "hidden": cfg.hidden_size, "intermediate": cfg.intermediate_size,
        "shared_experts": cfg.has_shared_experts, "tokens": list(c.tokens),
        "max_abs_err": o.max_abs_err, "atol": o.atol, "rtol": o.rtol,
        "quant_error": o.quant_error, "quant_error_bound": c.quant.spec.quant_error if c.quant.quantized else None,
        "seconds": round(o.seconds, 4), "status": o.status, "reason": o.reason,
    }


def summary(outcomes: list[CaseOutcome], wall: float, device: str) -> dict:
    counts = collections.Counter(o.status for o in outcomes)
    return {"total": len(outcomes), "valid": len(outcomes) - counts["skip"], "pass": counts["pass"],
            "fail": counts["fail"], "skip": counts["skip"], "error": counts["error"],
            "wall_seconds": round(wall, 2), "device": device,
            "world_sizes": sorted({o.case.world_size for o in outcomes}), "torch": torch.__version__}


def write_json(path: str, outcomes: list[CaseOutcome], wall: float, device: str) -> None:
    doc = {"cases": [case_json(o) for o in outcomes], "summary": summary(outcomes, wall, device)}
    atomic_write_text(path, json.dumps(doc, indent=1) + "\n")


def _fmt(v: float | None, digits: int = 2) -> str:
    return "" if v is None else f"{v:.{digits}e}"


def print_table(console: Console, outcomes: list[CaseOutcome], show_skipped: bool = False) -> None:
    table = Table(title="moeshard check", show_lines=False, header_style="bold")
    for col in ("layout", "backend", "quant", "dtype", "shape", "tokens", "max err", "tol (a/r)", "qerr", "status"):
        table.add_column(col, no_wrap=True)
    for o in outcomes:
        if o.status == "skip" and not show_skipped:
            continue
        c = o.case
        cfg = c.moe_config()
        p = c.parallel
        table.add_row(p.name + (" SP" if p.is_sequence_parallel else ""), escape(c.backend),
                      escape(c.quant.name), c.dtype,
                      escape(f"{c.preset} E{cfg.num_experts}k{cfg.top_k} H{cfg.hidden_size} I{cfg.intermediate_size}"
                             + (" +shared" if cfg.has_shared_experts else "")),
                      ",".join(map(str, c.tokens)), _fmt(o.max_abs_err),
                      "" if o.atol is None else f"{o.atol:.0e}/{o.rtol:.0e}", _fmt(o.quant_error, 1),
                      f"[{STYLE[o.status]}]{o.status}[/]")
    console.print(table)


def print_problems(console: Console, outcomes: list[CaseOutcome]) -> None:
    """Every failed or errored case with its id (for --only) and its reason, in full."""
    bad = [o for o in outcomes if o.status in ("fail", "error")]
    for o in bad:
        console.print(f"[{STYLE[o.status]}]{o.status.upper()}[/] {escape(o.case.id)}\n    {escape(o.reason)}",
                      highlight=False)


def print_skips(console: Console, outcomes: list[CaseOutcome]) -> None:
    reasons = collections.Counter(o.reason for o in outcomes if o.status == "skip")
    if reasons:
        console.print(f"[yellow]skipped[/] {sum(reasons.values())} cases (ids in --list and --json):")
        for reason, n in reasons.most_common():
            console.print(f"  {n:4d} x {escape(reason)}", highlight=False)


def print_summary(console: Console, outcomes: list[CaseOutcome], wall: float, device: str) -> None:
    s = summary(outcomes, wall, device)
    colour = "green" if s["fail"] == s["error"] == 0 else "bold red"
    console.print(f"[{colour}]{s['pass']} passed, {s['fail']} failed, {s['error']} errors[/], "
                  f"{s['skip']} skipped; {s['valid']} of {s['total']} cases valid; "
                  f"world sizes {s['world_sizes']} on {device}; wall time {wall:.1f} s")
