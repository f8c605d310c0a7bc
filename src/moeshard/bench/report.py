"""The benchmark's outputs: a rich table readable at a glance, JSON, and a PNG of the ratios."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console, JustifyMethod
from rich.table import Table

from moeshard.finite import json_text
from moeshard.outputs import atomic_write, atomic_write_text

SHORT = {"mixtral-8x7b": "mixtral", "qwen3-30b-a3b": "qwen3", "deepseek-v3": "dsv3"}


def _pct(x: float | None) -> str:
    return "" if x is None else f"{100 * x:.0f}%"


def _x(x: float | None) -> str:
    return "" if x is None else f"{x:.2f}x"


def _ratio_style(value: float | None, good: float) -> str:
    if value is None:
        return ""
    return "green" if value >= good else ("yellow" if value >= 0.8 * good else "red")


def _styled(text: str, style: str) -> str:
    return f"[{style}]{text}[/]" if style and text else text


def results_table(result: dict) -> Table:
    """One row per case; ratios coloured against the performance targets (``targets``)."""
    c = result["ceilings"]
    d = result["device"]
    t = Table(title=f"moeshard bench on {d['name']} ({d['date_utc']}); dense bf16 {c['matmul']['tflops']:.0f} "
                    f"TFLOP/s, copy {c['copy']['gbps']:.0f} GB/s", title_justify="left")
    columns: tuple[tuple[str, JustifyMethod], ...] = (
        ("model", "left"), ("T", "right"), ("quant", "left"), ("experts ms", "right"),
        ("TFLOP/s", "right"), ("% peak", "right"), ("W GB/s", "right"), ("% copy", "right"),
        ("vs grouped_mm", "right"), ("vs loop", "right"), ("vs bf16", "right"),
        ("layer ms", "right"), ("layer/experts", "right"), ("layer/all experts", "right"))
    for col, just in columns:
        t.add_column(col, justify=just)
    last = None
    for r in result["records"]:
        q = r["ratios"]
        if "experts_ms" not in r:
            t.add_row(SHORT.get(r["model"], r["model"]), str(r["tokens"]), r["quant"], "[red]error")
            continue
        if last is not None and (r["model"], r["quant"]) != last:
            t.add_section()
        last = (r["model"], r["quant"])
        prefill = r["regime"] == "prefill"
        t.add_row(
            SHORT.get(r["model"], r["model"]), str(r["tokens"]), r["quant"], f"{r['experts_ms']:.3f}",
            f"{r['expert_tflops']:.0f}",
            _styled(_pct(q["vs_peak"]), _ratio_style(q["vs_peak"], 0.8) if prefill else ""),
            f"{r['weight_gbps']:.0f}",
            _styled(_pct(q["vs_copy"]), "" if prefill else _ratio_style(q["vs_copy"], 0.85)),
            _styled(_x(q.get("vs_grouped_mm")), _ratio_style(q.get("vs_grouped_mm"), 1.05)),
            _x(q.get("vs_loop")),
            _styled(_x(q.get("vs_bf16")), _ratio_style(q.get("vs_bf16"), 1.5) if r["quant"] == "fp8_block" and prefill else ""),
            f"{r['layer_ms']:.3f}" if "layer_ms" in r else "",
            _styled(_pct(q.get("layer_over_experts")), _ratio_style(q.get("layer_over_experts"), 0.85) if prefill else ""),
            _styled(_pct(q.get("layer_over_all_experts")),
                    _ratio_style(q.get("layer_over_all_experts"), 0.85) if prefill else ""),
        )
    return t


def targets_table(targets: list[dict]) -> Table:
    t = Table(title="targets (ratios from this run)", title_justify="left")
    for col in ("target", "threshold", "worst case", "met"):
        t.add_column(col)
    for g in targets:
        met = "not on this GPU" if g.get("not_evaluated") else {True: "[green]yes", False: "[red]no", None: "not run"}[g["met"]]
        worst = "" if g["worst"] is None else f"{g['worst']:.2f}"
        t.add_row(g["name"], f">= {g['threshold']}", worst, met)
    return t


def tune_table(entries: list[dict]) -> Table:
    t = Table(title="tile sweep (fastest per GEMM marked *)", title_justify="left")
    for col in ("scheme", "shape", "gemm", "BMxBNxBK", "G", "warps", "stages", "tma", "ms", "TFLOP/s"):
        t.add_column(col)
    fastest: dict[tuple[str, str, int, str], float] = {}
    for e in entries:
        if "ms" in e:
            key = (e["scheme"], e["model"], e["tokens"], e["gemm"])
            fastest[key] = min(fastest.get(key, float("inf")), e["ms"])
    for e in entries:
        c = e["config"]
        key = (e["scheme"], e["model"], e["tokens"], e["gemm"])
        mark = "*" if "ms" in e and e["ms"] == fastest.get(key) else ""
        t.add_row(e["scheme"], f"{SHORT.get(e['model'], e['model'])} T={e['tokens']}", e["gemm"],
                  f"{c['block_m']}x{c['block_n']}x{c['block_k']}", str(c["group_m"]), str(c["num_warps"]),
                  str(c["num_stages"]), "y" if c["tma"] else "", (f"{e['ms']:.3f}{mark}" if "ms" in e else "error"),
                  f"{e['tflops']:.0f}" if "tflops" in e else e.get("error", "")[:40])
    return t


def print_tables(result: dict, console: Console | None = None) -> None:
    console = console or Console(width=180)
    if result.get("records"):
        console.print(results_table(result))
    if result.get("targets"):
        console.print(targets_table(result["targets"]))
    if result.get("tune"):
        console.print(tune_table(result["tune"]))


def write_json(result: dict, path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json_text(result))  # strict JSON: the command refused or nulled any NaN


def plot(result: dict, path: str | Path) -> str | None:
    """PNG with four panels of ratios; returns None, or why no plot was written (no matplotlib)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'moeshard[plot]')"
    recs = result["records"]
    quants = sorted({r["quant"] for r in recs}, key=["none", "fp8_tensor", "fp8_token", "fp8_block", "nvfp4"].index)
    fig, axes = plt.subplots(2, 2, figsize=(16, 10))
    panels = [
        (axes[0, 0], "prefill", "vs_peak", 0.80, "prefill: expert TFLOP/s / dense bf16 matmul"),
        (axes[0, 1], "prefill", "vs_grouped_mm", 1.05, "prefill bf16: speed-up over torch._grouped_mm (GEMMs only)"),
        (axes[1, 0], "decode", "vs_copy", 0.85, "decode: weight bytes read / copy bandwidth"),
        (axes[1, 1], None, "layer_over_experts", 0.85, "whole layer: experts time / layer time"),
    ]
    for ax, regime, key, target, title in panels:
        cases = sorted({(r["model"], r["tokens"]) for r in recs if regime in (None, r["regime"])},
                       key=lambda c: (list(SHORT).index(c[0]) if c[0] in SHORT else 99, c[1]))
        width = 0.8 / max(1, len(quants))
        for i, q in enumerate(quants):
            vals = []
            for m, tk in cases:
                r = next((r for r in recs if r["model"] == m and r["tokens"] == tk and r["quant"] == q), None)
                vals.append(r["ratios"].get(key, 0) if r else 0)
            ax.bar([j + i * width for j in range(len(cases))], vals, width, label=q)
        ax.axhline(target, color="k", linestyle="--", linewidth=1, label=f"target {target}")
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cases))])
        ax.set_xticklabels([f"{SHORT.get(m, m)}\nT={tk}" for m, tk in cases], fontsize=8 if len(cases) <= 12 else 6)
        ax.set_title(title, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    axes[0, 0].legend(fontsize=8)
    d = result["device"]
    fig.suptitle(f"moeshard bench, {d['name']}, {d['date_utc']} (ratios against figures of the same run)")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    try:
        atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    finally:
        plt.close(fig)
    return None
