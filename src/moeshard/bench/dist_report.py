"""Tables and a plot for ``moeshard bench --world-size N`` (records of ``bench.distributed``)."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.table import Table

from moeshard.bench.report import SHORT
from moeshard.outputs import atomic_write


def _ms(v: float | None) -> str:
    return "" if v is None else (f"{v * 1000:.0f}us" if v < 1 else f"{v:.2f}")


def _best(r: dict) -> float | None:
    return r.get("graph_ms") or r.get("layer_ms")


def layer_table(result: dict) -> Table:
    """Rows: model, quant, tokens per rank; columns: each run's layer time (graph-replayed where
    the backend allows it, else eager) and its ratio to the DP run (no communication)."""
    records = result["records"]
    runs = list(dict.fromkeys(r["run"] for r in records))
    t = Table(title=f"layer per rank, ms (x DP without EP) on {result['world_size']} x {result['device']['name']}",
              title_justify="left")
    for col in ("model", "quant", "T", *runs):
        t.add_column(col, justify="left" if col in ("model", "quant") else "right")
    keys = list(dict.fromkeys((r["model"], r["quant"], r["tokens"]) for r in records))
    by = {(r["model"], r["quant"], r["tokens"], r["run"]): r for r in records}
    for model, quant, tokens in keys:
        cells = []
        for run in runs:
            r = by.get((model, quant, tokens, run))
            if r is None:
                cells.append("")
                continue
            v, ratio = _best(r), r.get("ratios", {}).get("vs_dp")
            eager = "" if "graph_ms" not in r or r.get("layer_ms") is None else f" e{_ms(r['layer_ms'])}"
            cells.append(("[red]error" if v is None else _ms(v)) + ("" if ratio is None or run == "DP" else f" ({ratio:.2f}x)")
                         + eager)
        t.add_row(SHORT.get(model, model), quant, str(tokens), *cells)
    return t


def comm_table(result: dict) -> Table:
    """Dispatch and combine alone: time, payload GB/s, and against the raw NCCL all-to-all."""
    t = Table(title="dispatch + combine per rank (payload: routed rows x row bytes, each way)", title_justify="left")
    for col in ("model", "quant", "T", "run", "dispatch", "GB/s", "combine", "GB/s", "raw a2a", "raw / ours"):
        t.add_column(col)
    for r in result["records"]:
        if r.get("dispatch_ms") is None:
            continue
        raw = (r.get("raw_dispatch_ms") or 0) + (r.get("raw_combine_ms") or 0)
        t.add_row(SHORT.get(r["model"], r["model"]), r["quant"], str(r["tokens"]), r["run"], _ms(r["dispatch_ms"]),
                  f"{r.get('dispatch_gbps', 0):.0f}", _ms(r["combine_ms"]), f"{r.get('combine_gbps', 0):.0f}",
                  _ms(raw), f"{r['ratios'].get('comm_vs_raw', 0):.2f}")
    return t


def print_tables(result: dict, console: Console | None = None) -> None:
    console = console or Console(width=220)
    console.print(layer_table(result))
    console.print(comm_table(result))


def plot(result: dict, path: str | Path) -> str | None:
    """PNG: layer time against tokens per rank, one panel per (model, quant), one line per run;
    returns None, or why no plot was written."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'moeshard[plot]')"
    records = result["records"]
    panels = list(dict.fromkeys((r["model"], r["quant"]) for r in records))
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 5), squeeze=False)
    for ax, (model, quant) in zip(axes[0], panels, strict=True):
        for run in dict.fromkeys(r["run"] for r in records):
            pts = sorted((r["tokens"], _best(r)) for r in records
                         if r["model"] == model and r["quant"] == quant and r["run"] == run and _best(r))
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=run)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("tokens per rank")
        ax.set_ylabel("layer ms (graph where possible)")
        ax.set_title(f"{SHORT.get(model, model)} {quant}")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"moeshard bench, {result['world_size']} x {result['device']['name']}, {result['device']['date_utc']}")
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    plt.close(fig)
    return None
