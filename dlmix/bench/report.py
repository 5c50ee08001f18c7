"""Benchmark output: a rich table, ``results.json``/``requests.jsonl`` files, and PNG plots (matplotlib, Agg).

Folder layout (``--output-dir OUT``, one sub-folder per ``--label``)::

    OUT/LABEL/results.json      settings + per-level metrics (one object)
    OUT/LABEL/requests.jsonl    per-request records of every level (level index, TTFT, ITL, ...)
    OUT/latency_vs_load.png     every label found under OUT, one line per label (so two runs with different
    OUT/throughput_vs_load.png  router policies and the same OUT give comparison plots)
    OUT/summary.json            one object: label -> list of per-level headline figures
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional

from rich.console import Console
from rich.table import Table

__all__ = ["render_table", "write_results", "plot_dir", "load_level_x"]


def _f(v: Optional[float], nd: int = 1) -> str:
    return "-" if v is None else f"{v:.{nd}f}"


def render_table(data: dict, console: Optional[Console] = None, title: str = "") -> Table:
    """Print one run (``results.json`` content) as a table: a row per load level. A level where no request
    succeeded shows ``-`` for the latencies (its ``results.json`` zeros, as ``vllm bench serve`` writes them, are no
    measurement: a 0.0 ms TTFT read as the fastest level)."""
    pct = [k for k in data["levels"][0]["metrics"]["ttft_ms"] if k.startswith("p")] if data["levels"] else []
    hi = pct[-1] if pct else "max"
    t = Table(title=title or f"dlmix bench: {data.get('label', '')} -> {data.get('base_url', '')}")
    cols = ["load", "ok/fail", "req/s", "out tok/s", f"TTFT p50/{hi}", f"TPOT p50/{hi}", f"ITL p50/{hi}",
            f"E2EL p50/{hi}", "goodput req/s (good %)", "prefix hit %"]
    for c in cols:
        t.add_column(c, justify="right" if c != "load" else "left")
    for lv in data["levels"]:
        m, p = lv["metrics"], lv["prefix"]
        good = m.get("good_fraction")

        def pair(key: str) -> str:
            if not m["completed"]:
                return "-"
            return f"{_f(m[key]['median'])} / {_f(m[key].get(hi))}"

        t.add_row(lv["level"]["label"], f"{m['completed']}/{m['failed']}", _f(m["request_throughput"], 2),
                  _f(m["output_throughput"]), pair("ttft_ms"), pair("tpot_ms"), pair("itl_ms"), pair("e2el_ms"),
                  "-" if good is None else f"{_f(m.get('request_goodput'), 2)} ({100 * good:.0f}%)",
                  "-" if p.get("rate") is None else f"{100 * p['rate']:.1f} ({p['source']})")
    console = console or Console()
    if not console.is_terminal:
        console.width = max(console.width, 160)
    console.print(t)
    return t


def write_results(out_dir: Path, label: str, data: dict, raw_results: list) -> Path:
    """Write ``OUT/LABEL/results.json`` and ``requests.jsonl``; returns the run folder."""
    d = Path(out_dir) / label
    d.mkdir(parents=True, exist_ok=True)
    (d / "results.json").write_text(json.dumps(data, indent=1, default=_json_default))
    with open(d / "requests.jsonl", "w") as f:
        for i, level in enumerate(raw_results):
            for r in level:
                f.write(json.dumps({"level": i, **r.to_dict()}) + "\n")
    return d


def _json_default(o):
    if isinstance(o, float) and math.isinf(o):
        return "inf"
    raise TypeError(type(o).__name__)


def load_level_x(level: dict) -> tuple[str, float]:
    """(axis name, value) of a level for plotting: offered request rate, else concurrency."""
    rate = level.get("request_rate")
    if isinstance(rate, str):
        rate = float(rate)
    if rate is not None and not math.isinf(rate):
        return "request rate (req/s)", float(rate)
    if level.get("max_concurrency"):
        return "max concurrency", float(level["max_concurrency"])
    return "level", 0.0


def plot_dir(out_dir: Path) -> list[Path]:
    """Plot every ``OUT/*/results.json`` together; returns the PNG paths written (empty without runs)."""
    from dlmix.plotting import pyplot

    plt = pyplot()

    out_dir = Path(out_dir)
    runs = {}
    for f in sorted(out_dir.glob("*/results.json")):
        try:
            runs[f.parent.name] = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
    if not runs:
        return []
    hi_key = None
    written = []
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    panels = [("ttft_ms", "TTFT (ms)"), ("tpot_ms", "TPOT (ms)"), ("itl_ms", "ITL (ms)"), ("e2el_ms", "E2E latency (ms)")]
    xname = "load"
    summary = {}
    colors = plt.rcParams["axes.prop_cycle"].by_key().get("color", ["C0", "C1", "C2", "C3"])
    for n, (label, data) in enumerate(runs.items()):
        color = colors[n % len(colors)]
        lvls = data.get("levels") or []
        if not lvls:
            continue
        xs = []
        for lv in lvls:
            xname, x = load_level_x(lv["level"])
            xs.append(x)
        pk = [k for k in lvls[0]["metrics"]["ttft_ms"] if k.startswith("p") and k != "p50"]
        hi_key = pk[-1] if pk else "max"
        for ax, (key, title) in zip(axes.flat, panels):
            ax.plot(xs, [lv["metrics"][key]["median"] for lv in lvls], marker="o", color=color, label=f"{label} p50")
            ax.plot(xs, [lv["metrics"][key][hi_key] for lv in lvls], marker="x", linestyle="--", color=color,
                    label=f"{label} {hi_key}")
            ax.set_title(title)
            ax.set_xlabel(xname)
            ax.grid(True, alpha=0.3)
        summary[label] = [{"load": lv["level"]["label"], "ttft_p50_ms": lv["metrics"]["ttft_ms"]["median"],
                           "tpot_p50_ms": lv["metrics"]["tpot_ms"]["median"],
                           "e2el_p50_ms": lv["metrics"]["e2el_ms"]["median"],
                           "output_throughput": lv["metrics"]["output_throughput"],
                           "request_goodput": lv["metrics"].get("request_goodput"),
                           "prefix_hit_rate": lv["prefix"].get("rate")} for lv in lvls]
    for ax in axes.flat:
        ax.legend(fontsize=7)
    fig.suptitle("dlmix bench: latency vs load")
    fig.tight_layout()
    p = out_dir / "latency_vs_load.png"
    fig.savefig(p, dpi=100)
    plt.close(fig)
    written.append(p)

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for label, data in runs.items():
        lvls = data.get("levels") or []
        if not lvls:
            continue
        xs = [load_level_x(lv["level"])[1] for lv in lvls]
        axes[0].plot(xs, [lv["metrics"]["output_throughput"] for lv in lvls], marker="o", label=label)
        axes[1].plot(xs, [lv["metrics"].get("request_goodput") or 0.0 for lv in lvls], marker="o", label=label)
        axes[2].plot(xs, [100 * (lv["prefix"].get("rate") or 0.0) for lv in lvls], marker="o", label=label)
    for ax, title in zip(axes, ("output throughput (tok/s)", "goodput (req/s)", "prefix hit rate (%)")):
        ax.set_title(title)
        ax.set_xlabel(xname)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    p = out_dir / "throughput_vs_load.png"
    fig.savefig(p, dpi=100)
    plt.close(fig)
    written.append(p)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    return written
