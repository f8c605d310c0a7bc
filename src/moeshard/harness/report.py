"""The report of a check run: a compact summary (default), the full table (``--verbose``), the
problems in full, and the JSON document (every case, always).

The summary has one row per layout x backend that ran (and one per layout x backend of the
gradient cases, "<backend> backward", with ``--backward``), in matrix order: how many of its cases
passed, the worst error relative to its bound over all of them (``err/bound``: 1 is the edge of
the tolerance), and its slowest case. Combinations that cannot run by construction (a backend
that needs expert parallelism on a layout without it, ...) get no row: one line below the table
counts them, and the cases refused within the rows that ran, and says where each is listed with
its reason (``--list``, ``--verbose``, ``--json``), so nothing is left out silently.

JSON schema (stable; later versions only add keys):
  {"cases": [{"id", "layout": {"dp", "tp", "ep", "sp"}, "backend", "quant", "defer_input_quant",
              "dtype", "preset", "num_experts", "top_k", "hidden", "intermediate", "shared_experts", "backward",
              "tokens": [per DP rank], "max_abs_err", "atol", "rtol", "err_to_bound", "quant_error",
              "quant_error_bound", "seconds", "status": "pass|fail|error|not_applicable|skip", "reason",
              "explanation": [lines], "stages": {"first", "wrong_rows", "headline", "lines"} | null}],
   "summary": {"total", "valid", "pass", "fail", "error", "not_applicable", "skip", "wall_seconds",
               "device", "world_sizes", "torch"}}
  status not_applicable: the matrix refuses the combination by construction (``reason`` says
  why); skip: could run, but not here (e.g. fewer GPUs than ranks). valid: the cases that ran.
  err_to_bound: max over every element of |out - ref| / (atol + rtol |ref| + slack); for a
  gradient case ("backward": true, ``moeshard.harness.grads``) also over every row of every
  gradient, |got - ref| / (the row's scale x the gradient bound).
  explanation: why a case failed, in words: for an error (a rank raised or hung), where the ranks'
  collective sequences part (``moeshard.parallel.trace``); with --explain, the first stage out of
  bound (``moeshard.harness.explain``), whose details are in "stages".
"""

from __future__ import annotations

import collections

import torch
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from moeshard.finite import json_text, with_nulls
from moeshard.harness.runner import CaseOutcome
from moeshard.outputs import atomic_write_text

# Ids, reasons and the ranks' error messages are foreign text (a gloo message holds
# "[/.../pair.cc:553]", torch's "[enforce fail at alloc_cpu.cpp:127]"): they are always printed
# through rich.markup.escape, never read as markup; only our own style tags are markup.

STYLE = {"pass": "green", "fail": "bold red", "error": "bold red", "skip": "yellow", "not_applicable": "dim"}
LABEL = {"pass": "passed", "fail": "failed", "error": "errors", "skip": "skipped", "not_applicable": "not applicable"}


def case_json(o: CaseOutcome) -> dict:
    c, cfg = o.case, o.case.moe_config()
    p = c.parallel
    return {
        "id": c.id,
        "layout": {"dp": p.dp, "tp": p.tp, "ep": p.enable_ep, "sp": p.is_sequence_parallel},
        "backend": c.backend, "quant": c.quant.scheme, "defer_input_quant": c.quant.defer_input_quant,
        "dtype": c.dtype, "preset": c.preset, "num_experts": cfg.num_experts, "top_k": cfg.top_k,
        "hidden": cfg.hidden_size, "intermediate": cfg.intermediate_size,
        "shared_experts": cfg.has_shared_experts, "backward": c.grad, "tokens": list(c.tokens),
        "max_abs_err": o.max_abs_err, "atol": o.atol, "rtol": o.rtol, "err_to_bound": o.err_to_bound,
        "quant_error": o.quant_error, "quant_error_bound": c.quant.spec.quant_error if c.quant.quantized else None,
        "seconds": round(o.seconds, 4), "status": o.status, "reason": o.reason,
        "explanation": list(o.explanation), "stages": None if o.stages is None else o.stages.as_json(),
    }


def summary(outcomes: list[CaseOutcome], wall: float, device: str) -> dict:
    counts = collections.Counter(o.status for o in outcomes)
    return {"total": len(outcomes), "valid": len(outcomes) - counts["not_applicable"] - counts["skip"],
            "pass": counts["pass"], "fail": counts["fail"], "error": counts["error"],
            "not_applicable": counts["not_applicable"], "skip": counts["skip"],
            "wall_seconds": round(wall, 2), "device": device,
            "world_sizes": sorted({o.case.world_size for o in outcomes}), "torch": torch.__version__}


def write_json(path: str, outcomes: list[CaseOutcome], wall: float, device: str) -> None:
    doc = {"cases": [case_json(o) for o in outcomes], "summary": summary(outcomes, wall, device)}
    # A case's NaN or infinite error is part of its verdict (it failed, its reason says why): in
    # the JSON it is null, named under "nonfinite", never a NaN token that is not JSON.
    atomic_write_text(path, json_text(with_nulls(doc)))


def _fmt(v: float | None, digits: int = 2) -> str:
    return "" if v is None else f"{v:.{digits}e}"


def _layout(o: CaseOutcome) -> str:
    p = o.case.parallel
    return p.name + (" SP" if p.is_sequence_parallel else "")


def _counts(group: list[CaseOutcome]) -> str:
    counts = collections.Counter(o.status for o in group)
    return ", ".join(f"[{STYLE[s]}]{counts[s]} {LABEL[s]}[/]" for s in LABEL if counts[s])


def print_summary_table(console: Console, outcomes: list[CaseOutcome]) -> None:
    """One row per layout x backend with cases that ran (or were skipped here): their statuses,
    worst error / bound, slowest case. Then one line that counts what is not applicable by
    construction: whole combinations, and cases within the rows shown."""
    groups: dict[tuple[str, str, bool], list[CaseOutcome]] = {}
    for o in outcomes:  # the gradient cases of a layout x backend get a row of their own
        groups.setdefault((o.case.parallel.name, o.case.backend, o.case.grad), []).append(o)
    table = Table(title="moeshard check", header_style="bold")
    for col in ("layout", "backend", "cases", "err/bound", "slowest case (s)"):
        table.add_column(col, no_wrap=True)
    partial = 0
    absent: list[list[CaseOutcome]] = []
    for group in groups.values():
        ran = [o for o in group if o.status in ("pass", "fail", "error")]
        if not ran and all(o.status == "not_applicable" for o in group):
            absent.append(group)
            continue
        partial += sum(o.status == "not_applicable" for o in group)
        worst = max((o.err_to_bound for o in ran if o.err_to_bound is not None), default=None)
        slow = max(ran, key=lambda o: o.seconds) if ran else None
        note = "" if slow is None else f"{slow.seconds:5.2f}  " + slow.case.id.split("/", 2)[2]
        colour = "bold red" if worst is not None and worst > 1 else ""
        backend = group[0].case.backend + (" backward" if group[0].case.grad else "")
        table.add_row(_layout(group[0]), escape(backend), _counts(group),
                      "" if worst is None else f"[{colour}]{worst:.2f}[/]" if colour else f"{worst:.2f}",
                      escape(note))
    console.print(table, highlight=False)
    if absent or partial:
        cases = sum(len(g) for g in absent)
        parts = []
        if absent:
            parts.append(f"{len(absent)} layout x backend combinations ({cases} cases)")
        if partial:
            parts.append(f"{partial} cases within the rows above")
        console.print(f"[dim]not applicable by construction: {' and '.join(parts)}; "
                      f"--list or --verbose shows each with its reason[/]", highlight=False)


def print_table(console: Console, outcomes: list[CaseOutcome]) -> None:
    """Every case, one row each (``--verbose``)."""
    table = Table(title="moeshard check", show_lines=False, header_style="bold")
    for col in ("layout", "backend", "quant", "dtype", "shape", "tokens", "max err", "err/bound", "tol (a/r)",
                "qerr", "status"):
        table.add_column(col, no_wrap=True)
    for o in outcomes:
        c = o.case
        cfg = c.moe_config()
        table.add_row(_layout(o), escape(c.backend), escape(c.quant.name), c.dtype,
                      escape(f"{c.preset} E{cfg.num_experts}k{cfg.top_k} H{cfg.hidden_size} I{cfg.intermediate_size}"
                             + (" +shared" if cfg.has_shared_experts else "")),
                      ",".join(map(str, c.tokens)), _fmt(o.max_abs_err),
                      "" if o.err_to_bound is None else f"{o.err_to_bound:.2f}",
                      "" if o.atol is None else f"{o.atol:.0e}/{o.rtol:.0e}", _fmt(o.quant_error, 1),
                      f"[{STYLE[o.status]}]{LABEL[o.status] if o.status == 'not_applicable' else o.status}[/]")
    console.print(table)


def print_problems(console: Console, outcomes: list[CaseOutcome]) -> None:
    """Every failed or errored case with its id (for --only), its reason in full and, where
    there is one, its explanation; then the explanations of passing cases (--explain --only)."""
    for o in outcomes:
        if o.status in ("fail", "error"):
            console.print(f"[{STYLE[o.status]}]{o.status.upper()}[/] {escape(o.case.id)}\n    {escape(o.reason)}",
                          highlight=False)
        elif not o.explanation:
            continue
        else:
            console.print(f"[{STYLE[o.status]}]{o.status.upper()}[/] {escape(o.case.id)}", highlight=False)
        for i, line in enumerate(o.explanation):
            console.print(("    explain: " if i == 0 else "             ") + escape(line), highlight=False)


def print_skips(console: Console, outcomes: list[CaseOutcome]) -> None:
    """Cases that could run but were not run here, by reason."""
    reasons = collections.Counter(o.reason for o in outcomes if o.status == "skip")
    if reasons:
        console.print(f"[yellow]skipped[/] {sum(reasons.values())} cases that could run elsewhere:")
        for reason, n in reasons.most_common():
            console.print(f"  {n:4d} x {escape(reason)}", highlight=False)


def print_summary(console: Console, outcomes: list[CaseOutcome], wall: float, device: str) -> None:
    s = summary(outcomes, wall, device)
    colour = "green" if s["fail"] == s["error"] == 0 else "bold red"
    skipped = f", {s['skip']} skipped" if s["skip"] else ""
    console.print(f"[{colour}]{s['pass']} passed, {s['fail']} failed, {s['error']} errors[/]{skipped}; "
                  f"{s['not_applicable']} of {s['total']} cases not applicable by construction; "
                  f"world sizes {s['world_sizes']} on {device}; wall time {wall:.1f} s")
